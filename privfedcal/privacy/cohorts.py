"""Fixed cohorts for secure aggregation, and the checker of a run's participation record.

A secure aggregate hides each upload inside a sum, but the server sees every round's sum
and who took part in it: sums over different sets of clients subtract. A value that does not
change between rounds (a client's class counts, its size) is then recovered exactly by least
squares, and one that changes slowly (a model update, a class gradient) approximately
(gradient disaggregation, Lam et al., ICML 2021). What the server can learn from all the
sums of a run is their row space: for every vector ``v`` in the span of the participation
rows (and of the all-ones row, where the total over every client is public), it learns
``sum_k v_k x_k``. A group ``G`` of clients is *isolated* when some non-zero ``v`` in that
span is supported inside ``G``.

The protocol therefore groups the clients once per run into fixed cohorts of at least ``m``
clients (``--secagg-min-clients``), drawn from the public seed, and every round with partial
participation selects whole cohorts (So et al., "Securing Secure Aggregation: Mitigating
Multi-Round Privacy Leakage in Federated Learning", AAAI 2023). Every participation row is
then a union of cohorts, so is every vector of their span: nothing finer than a cohort is
ever isolated. A member that was not asked, or whose upload is lost or rejected, removes
its whole public cohort from a secure sum (``complete_cohorts``) so that the rule survives
dropouts, and the key holder decrypts only a sum whose contributors are whole cohorts
(``whole_cohorts``).

``isolated_group`` is the independent check: it takes the participant sets of every secure
release of a run and returns a group of fewer than ``m`` clients that the sums isolate, or
None. It is exact (every group of ``m - 1`` clients is tested) when there are at most
``EXACT_LIMIT`` such groups, and conservative above it (it then requires every set of
clients with identical participation to hold at least ``m`` clients, which implies the
guarantee; an exact search runs only when that implication fails). The planner runs it on
the planned schedule before training, the secure wire before every decryption on the sums
already released plus the new sum's actual contributors (``release_isolates``: a sum that
fails is withheld, never decrypted), and the run on its actual record at the end.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from privfedcal.errors import UsageError
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError

#: purpose tag of the cohort draw (seeding.derive_seed's last part)
COHORT_PURPOSE = 11
#: groups of ``m - 1`` clients the exact check tests at most; above it the check is the
#: conservative one on identical participation columns
EXACT_LIMIT = 200_000
#: a group is isolated when the largest singular value of its rows of an orthonormal basis
#: of the row space reaches 1 within this tolerance (exactly 1 in exact arithmetic)
TOLERANCE = 1e-9


def per_round(clients: int, participation: float) -> int:
    """Clients a round asks for: ``round(participation * clients)``, at least 1."""
    return min(max(1, int(round(participation * clients))), clients)


def cohort_size(clients: int, asked: int, minimum: int) -> int:
    """The cohorts' nominal size: ``minimum`` when every client takes part in every round,
    else the smallest divisor of ``asked`` that is at least ``minimum``, so that a round of
    whole cohorts asks for ``asked`` clients when the cohorts are equal."""
    if asked < minimum or clients < minimum:
        raise SettingError("secure aggregation would sum {summed} upload(s) per release, "
                           "fewer than {secagg_min_clients=}: raise {clients} or "
                           "{participation}", summed=min(asked, clients),
                           secagg_min_clients=minimum)
    if asked >= clients:
        return minimum
    return next(s for s in range(minimum, asked + 1) if asked % s == 0)


def make_cohorts(clients: int, size: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """``clients // size`` cohorts of ``size`` clients drawn from the public ``seed``; the
    remaining ``clients % size`` clients join the first cohorts one each, so that every
    cohort holds at least ``size`` clients. Each cohort sorted, cohorts by first member."""
    if size < 1 or clients < size:
        raise UsageError(f"cannot form cohorts of {size} from {clients} clients")
    order: list[int] = torch.randperm(
        clients, generator=make_generator(seed, 0, 0, COHORT_PURPOSE)).tolist()
    count = clients // size
    groups = [order[i * size:(i + 1) * size] for i in range(count)]
    for i, client in enumerate(order[count * size:]):
        groups[i % count].append(client)
    return tuple(sorted(tuple(sorted(g)) for g in groups))


@dataclass(frozen=True)
class CohortPlan:
    """The run's cohorts and how many a round selects (``select``)."""

    cohorts: tuple[tuple[int, ...], ...]
    per_round: int  # cohorts selected per round

    @property
    def smallest(self) -> int:
        return min(len(c) for c in self.cohorts)

    def members(self) -> dict[int, int]:
        """Client -> index of its cohort."""
        return {c: i for i, group in enumerate(self.cohorts) for c in group}

    def to_dict(self) -> dict[str, Any]:
        return {"cohorts": [list(c) for c in self.cohorts], "per_round": self.per_round,
                "smallest": self.smallest}


def secure_minimum(cfg: Any) -> int:
    """Fewest uploads in a secure sum, and fewest clients in a cohort: ``--secagg-min-clients``
    m, and m + 1 when the key holder is one of the clients (``--secagg-key-holder``, set under
    Flower): it knows its own upload, so every sum needs m others besides it."""
    m = int(getattr(cfg, "secagg_min_clients", 2))
    return m + int(getattr(cfg, "secagg_key_holder", None) is not None)


def observers_own(cfg: Any) -> tuple[int, ...]:
    """Clients whose own values an observer of every secure sum knows: the key holder when
    it is a client."""
    holder = getattr(cfg, "secagg_key_holder", None)
    return () if holder is None else (int(holder),)


def secure_rounds(cfg: Any) -> bool:
    """Whether a run sums uploads securely (its selection then takes whole cohorts)."""
    return bool(getattr(cfg, "secagg", False) or getattr(cfg, "secagg_updates", False))


def cohort_plan(cfg: Any) -> CohortPlan:
    """The cohorts of a run, from its public config: cohorts of at least
    ``secure_minimum(cfg)`` clients under secure aggregation, single clients otherwise (then
    the selection is the plain draw of ``participation * clients`` clients)."""
    return _plan(cfg.clients, cfg.participation, secure_rounds(cfg), secure_minimum(cfg),
                 cfg.seed)


@functools.lru_cache(maxsize=64)
def _plan(clients: int, participation: float, secure: bool, minimum: int,
          seed: int) -> CohortPlan:
    asked = per_round(clients, participation)
    if not secure:
        return CohortPlan(tuple((c,) for c in range(clients)), asked)
    size = cohort_size(clients, asked, minimum)
    cohorts = make_cohorts(clients, size, seed)
    return CohortPlan(cohorts, len(cohorts) if asked >= clients else asked // size)


def select_clients(cfg: Any, round_: int) -> list[int]:
    """The clients of a round: a function of the public config alone (the privacy
    accounting plans each client's participation from it, privfedcal/privacy/planner.py);
    ``cfg`` is the run's ``PrivacyOptions`` (``exp.privacy``, or ``PrivacyOptions.of(cfg)``):
    ``clients``, ``participation``, ``seed``, and under secure aggregation
    ``secagg_min_clients`` and ``secagg_key_holder`` (whole cohorts are selected)."""
    return select_cohorts(cohort_plan(cfg), cfg.seed, round_)


def select_cohorts(plan: CohortPlan, seed: int, round_: int) -> list[int]:
    """The clients of a round: ``plan.per_round`` whole cohorts drawn from the public seed
    (with single-client cohorts, the same draw as a plain choice of clients)."""
    k = len(plan.cohorts)
    chosen: Sequence[int]
    if plan.per_round >= k:
        chosen = range(k)
    else:
        g = make_generator(seed, round_, 0, 3)
        chosen = torch.randperm(k, generator=g)[:plan.per_round].tolist()
    return sorted(c for i in chosen for c in plan.cohorts[i])


def cohort_groups(present: Iterable[int], cohorts: Sequence[Collection[int]] | None
                  ) -> tuple[list[list[int]], list[int]]:
    """``(groups, left_out)``: the clients of ``present`` in groups that may enter a secure
    sum, each a whole public cohort (clients in no cohort alone), and the present clients
    left out because a member of their cohort is missing. A member not asked, lost or
    rejected takes its whole cohort out, so the sum stays a union of cohorts whatever drops
    out (a cohort counted "as far as it was asked" would let a lost node's absence single
    it out against the run's other sums)."""
    present = list(dict.fromkeys(int(c) for c in present))
    have = set(present)
    if cohorts is None:
        return [[c] for c in present], []
    groups, kept = [], set()
    for group in cohorts:
        if set(group) <= have:
            groups.append(list(group))
            kept |= set(group)
    grouped = {c for g in cohorts for c in g}
    groups += [[c] for c in present if c not in grouped]  # clients in no cohort
    return groups, [c for c in present if c in grouped and c not in kept]


def complete_cohorts(present: Iterable[int],
                     cohorts: Sequence[Collection[int]] | None) -> set[int]:
    """The clients of ``present`` whose whole public cohort is present (``cohort_groups``)."""
    groups, _ = cohort_groups(present, cohorts)
    return {c for g in groups for c in g}


def whole_cohorts(contributors: Collection[int],
                  cohorts: Sequence[Collection[int]] | None) -> bool:
    """Whether ``contributors`` (no client twice) is a union of whole public cohorts: the key
    holder's own rule before it decrypts a sum (with no cohorts, every set is)."""
    listed = [int(c) for c in contributors]
    if len(set(listed)) != len(listed):
        return False
    return cohorts is None or complete_cohorts(listed, cohorts) == set(listed)


# ---- the checker -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Isolation:
    """A group of fewer than ``m`` clients the released sums isolate (``exact`` False: the
    conservative check could not rule it out)."""

    group: tuple[int, ...]
    exact: bool

    def describe(self) -> str:
        how = "isolate" if self.exact else "may isolate (conservative check)"
        return f"the sums across rounds {how} client(s) {list(self.group)}"


def participation_matrix(rows: Sequence[Collection[int]], clients: int,
                         public_total: bool = True) -> np.ndarray:
    """0/1 matrix, one row per released sum (plus the all-ones row of a public total)."""
    mat = np.zeros((len(rows) + int(public_total), clients))
    for i, row in enumerate(rows):
        for c in row:
            if not 0 <= int(c) < clients:
                raise UsageError(f"participant {c} is not a client (0..{clients - 1})")
            mat[i, int(c)] = 1.0
    if public_total:
        mat[-1] = 1.0
    return mat


def row_space_basis(mat: np.ndarray) -> np.ndarray:
    """An orthonormal basis of the row space, one basis vector per column (n x rank)."""
    if mat.shape[0] == 0:
        return np.zeros((mat.shape[1], 0))
    _, s, vt = np.linalg.svd(mat, full_matrices=False)
    rank = int((s > s.max(initial=0.0) * max(mat.shape) * 1e-12).sum()) if s.size else 0
    return vt[:rank].T


def atoms(mat: np.ndarray) -> list[tuple[int, ...]]:
    """Clients no sum tells apart (equal columns of ``mat``), in order of first client:
    every vector of the row space is constant on each."""
    groups: dict[bytes, list[int]] = {}
    for j in range(mat.shape[1]):
        groups.setdefault(np.ascontiguousarray(mat[:, j]).tobytes(), []).append(j)
    return [tuple(g) for g in groups.values()]


def isolates(basis: np.ndarray, group: Sequence[int]) -> bool:
    """Whether a non-zero vector of the row space is supported inside ``group``: the largest
    singular value of the group's rows of the orthonormal basis is 1."""
    if basis.shape[1] == 0 or not group:
        return False
    return float(np.linalg.norm(basis[list(group)], ord=2)) >= 1.0 - TOLERANCE


def isolated_group(rows: Sequence[Collection[int]], clients: int, m: int, *,
                   public_total: bool = True, known: Collection[int] = ()) -> Isolation | None:
    """A group of fewer than ``m`` clients (outside ``known``) whose sum some combination
    of the released sums determines, or None when there is none.

    ``rows``: the participants of every released sum of the run (one set per release, all
    labels together: the same client value may appear in several). ``public_total``: the sum
    over every client is public (class totals, the number of examples). ``known``: clients
    whose own values the observer holds (the key holder knows its own upload)."""
    if m <= 1:
        return None
    others = [c for c in range(clients) if c not in set(known)]
    mat = participation_matrix(rows, clients, public_total)[:, others]
    mat = mat[np.abs(mat).sum(axis=1) > 0]
    if mat.shape[0] == 0 or min(len(a) for a in atoms(mat)) >= m:
        return None  # every vector of the span is constant on atoms of >= m clients
    basis = row_space_basis(mat)
    if basis.shape[1] == 0:
        return None
    size = min(m - 1, len(others))
    if math.comb(len(others), size) <= EXACT_LIMIT:
        for sub in range(1, size + 1):
            for group in itertools.combinations(range(len(others)), sub):
                if isolates(basis, group):
                    return Isolation(tuple(others[i] for i in group), exact=True)
        return None
    # conservative: clients with identical columns are equal in every vector of the span,
    # so if each such class has >= m clients, every non-zero vector has >= m non-zeros
    small = min(atoms(mat), key=len)
    return Isolation(tuple(others[j] for j in small), exact=False) if len(small) < m else None


def whole_run_record(rows: Sequence[Collection[int]], clients: int, m: int,
                     known: Collection[int] = ()) -> dict[str, Any]:
    """``summary.json``'s statement of what the run's secure sums, taken together, isolate
    (checked on the actual contributors of every release; ``known``: clients whose values
    the key holder, who sees every sum, knows as its own)."""
    found = isolated_group(rows, clients, m, known=known)
    exact = found.exact if found is not None else (
        math.comb(clients, min(m - 1, clients)) <= EXACT_LIMIT)
    return {"secure_sums": len(rows), "min_clients": m, "holds": found is None,
            "observer_knows": sorted(int(c) for c in known),
            "isolated": list(found.group) if found is not None else None,
            "check": "exact" if exact else "conservative (identical participation columns)",
            "statement": ("no combination of the run's secure sums isolates fewer than "
                          f"{m} clients" if found is None else found.describe())}


def release_isolates(released: Sequence[Collection[int]], contributors: Collection[int],
                     clients: int, m: int, known: Collection[int] = ()) -> Isolation | None:
    """The check before a secure sum is decrypted: what the run's released sums
    (``released``: the contributors of each, every label and round) together with this
    sum's actual contributors would isolate (``isolated_group``); None: it may be released."""
    return isolated_group([*released, contributors], clients, m, known=known)


def check_schedule(rows: Sequence[Collection[int]], clients: int, m: int, *,
                   public_total: bool = True, known: Collection[int] = ()) -> None:
    """Refuse (UsageError) a schedule whose sums isolate fewer than ``m`` clients."""
    found = isolated_group(rows, clients, m, public_total=public_total, known=known)
    if found is not None:
        raise SettingError("{found}: fewer than {secagg_min_clients=}", found=found.describe(),
                           secagg_min_clients=m)


__all__ = ["COHORT_PURPOSE", "CohortPlan", "Isolation", "atoms", "check_schedule", "cohort_groups",
           "cohort_plan", "cohort_size", "complete_cohorts", "isolated_group", "make_cohorts",
           "observers_own", "participation_matrix", "per_round", "release_isolates",
           "row_space_basis", "secure_minimum", "secure_rounds", "select_clients", "select_cohorts",
           "whole_cohorts", "whole_run_record"]
