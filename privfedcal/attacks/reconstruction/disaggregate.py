"""Disaggregation across rounds: what secure sums over changing participant sets reveal.

Secure aggregation shows the server only the sum of a round's uploads, but a run makes many
such sums over different participant sets, and the server knows each set (it selects the
participants and the transcript names them). Stack them as ``A X = Y``: ``A`` the
participation matrix (one row per release, one column per client, 1 where the client is in
the sum), ``X`` the clients' values (one row each), ``Y`` the released sums. Rows of ones
with a public total (the federation's N, public class totals) join ``A`` where a total is
public. Then (Lam et al., "Gradient Disaggregation: Breaking Privacy in Federated Learning
by Reconstructing the User Participant Matrix", ICML 2021, section 3; here the participant
matrix is known, so only their least-squares step remains):

- client i's value is *determined* exactly when ``e_i`` lies in the row space of ``A``
  (then every solution of ``A X = Y`` has the same row i, the minimum-norm least-squares
  one included); ``P = A^+ A`` projects onto the row space, ``||P e_i||^2 = P_ii``, so this
  is ``P_ii = 1``;
- more generally the sum over a group S is determined when ``1_S`` lies in the row space;
  the *finest groups* are the minimal such S (no sub-group's sum is determined). With
  cohorts selected whole (docs/threat-model.md) no group is smaller than a cohort.

Values that do not change between rounds (hidden counts, sizes) are recovered exactly by
``solve``; values that change (model updates, class gradients) only under Lam et al.'s
assumption that each client's value is constant over a window of rounds (``solve_windows``),
where the fit's residual says how far that assumption is off. Pure numpy; the attack on a
run folder is ``disaggregate_attack.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from privfedcal.errors import UsageError
from privfedcal.privacy.cohorts import atoms as cohort_atoms
from privfedcal.privacy.cohorts import row_space_basis
from privfedcal.settings.messages import SettingError

#: subsets tried when searching the finest groups of the undetermined clients
MAX_SUBSETS = 200_000


@dataclass(frozen=True)
class Solution:
    """The least-squares disaggregation of ``A X = Y``."""

    values: np.ndarray  # (K, D) minimum-norm least-squares X
    determined: np.ndarray  # (K,) bool: e_i in the row space of A
    rank: int
    residual: float  # ||A X - Y||_F / ||Y||_F (0 when Y is 0)


def _check(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] == 0:
        raise UsageError(f"a participation matrix is 2-D with >= 1 client, got {a.shape}")
    if not np.isfinite(a).all():
        raise UsageError("the participation matrix holds a non-finite entry")
    return a


def projector(a: np.ndarray) -> tuple[np.ndarray, int]:
    """``(P, rank)``: the orthogonal projector onto the row space of ``a`` (K x K), from the
    orthonormal basis the whole-run check uses (``cohorts.row_space_basis``)."""
    basis = row_space_basis(_check(a))
    return basis @ basis.T, basis.shape[1]


def in_row_space(a: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Whether each row of ``vectors`` (n x K) lies in the row space of ``a``."""
    p, _ = projector(a)
    vectors = np.atleast_2d(np.asarray(vectors, dtype=np.float64))
    off = np.linalg.norm(vectors - vectors @ p, axis=1)
    return off <= 1e-6 * np.maximum(1.0, np.linalg.norm(vectors, axis=1))


def determined(a: np.ndarray) -> np.ndarray:
    """``(K,)`` bool: client i's value is fixed by the sums (``e_i`` in the row space)."""
    return in_row_space(a, np.eye(_check(a).shape[1]))


def solve(a: np.ndarray, y: np.ndarray) -> Solution:
    """The minimum-norm least-squares ``X`` of ``A X = Y`` (``y``: (R,) or (R, D)) and
    which of its rows are determined."""
    a = _check(a)
    y = np.asarray(y, dtype=np.float64)
    flat = y.reshape(y.shape[0], -1) if y.ndim else y.reshape(1, 1)
    if flat.shape[0] != a.shape[0]:
        raise UsageError(f"{a.shape[0]} participation rows but {flat.shape[0]} sums")
    _, rank = projector(a)
    if a.shape[0] == 0:
        x = np.zeros((a.shape[1], flat.shape[1]))
    else:
        x = np.linalg.lstsq(a, flat, rcond=None)[0]
    scale = float(np.linalg.norm(flat))
    residual = 0.0 if scale == 0 else float(np.linalg.norm(a @ x - flat)) / scale
    return Solution(x, determined(a), rank, residual)


def atoms(a: np.ndarray) -> list[tuple[int, ...]]:
    """Clients no sum ever tells apart (equal columns of ``a``), in order of first client
    (``cohorts.atoms``)."""
    return cohort_atoms(_check(a))


def finest_groups(a: np.ndarray, max_subsets: int = MAX_SUBSETS
                  ) -> tuple[list[tuple[int, ...]], bool]:
    """``(groups, complete)``: the minimal client groups whose sum is determined (smallest
    first). A group never splits clients with equal columns (``atoms``), and a minimal
    group of two or more atoms holds no determined atom (removing it would leave a smaller
    determined group), so only unions of undetermined atoms are searched, by size, up to
    ``max_subsets`` candidates (``complete`` False if the search stopped there)."""
    a = _check(a)
    k = a.shape[1]
    units = atoms(a)
    ind = np.zeros((len(units), k))
    for j, unit in enumerate(units):
        ind[j, list(unit)] = 1.0
    alone = in_row_space(a, ind)
    groups = [units[j] for j in range(len(units)) if alone[j]]
    rest = [j for j in range(len(units)) if not alone[j]]
    found: list[frozenset[int]] = []
    tried, complete = 0, True
    for size in range(2, len(rest) + 1):
        combos = [c for c in itertools.combinations(rest, size)
                  if not any(f <= set(c) for f in found)]
        if tried + len(combos) > max_subsets:
            complete = False
            break
        tried += len(combos)
        if not combos:
            continue
        hit = in_row_space(a, np.stack([ind[list(c)].sum(0) for c in combos]))
        found += [frozenset(c) for c, h in zip(combos, hit, strict=True) if h]
    groups += [tuple(sorted(i for j in f for i in units[j])) for f in found]
    return sorted(groups, key=lambda g: (len(g), g)), complete


def group_of(groups: Sequence[tuple[int, ...]], client: int) -> tuple[int, ...] | None:
    """The smallest group holding ``client`` (None: no determined group holds it)."""
    mine = [g for g in groups if client in g]
    return min(mine, key=len) if mine else None


def windows(rounds: Sequence[int], width: int) -> list[list[int]]:
    """Consecutive windows of ``width`` releases (0: one window of all of them), as indices
    into ``rounds``."""
    if width < 0:
        raise SettingError(f"{{window}} must be >= 0 (0: the whole run), got {width}")
    n = len(rounds)
    step = n if width == 0 else width
    return [list(range(s, min(n, s + step))) for s in range(0, n, max(step, 1))]


def solve_windows(a: np.ndarray, y: np.ndarray, width: int) -> list[Solution]:
    """Lam et al.'s least squares for values that change between rounds: each client's value
    taken as constant within each window of ``width`` consecutive releases (0: the whole
    run, i.e. the time average), one ``solve`` per window."""
    a = _check(a)
    y = np.asarray(y, dtype=np.float64)
    return [solve(a[w], y[w]) for w in windows(list(range(a.shape[0])), width)]
