"""Splitting a cohort's determined class counts between its members with their sizes.

Secure sums over whole cohorts determine each cohort's summed class counts ``S`` (C,) and
no finer sum (``disaggregate.py``). A client's size ``n_k`` is its count vector's total, so
where sizes reach the server (clear FedAvg weights) the members' counts ``x_k`` satisfy

    x_k >= 0 integer,   sum_k x_k = S,   sum_c x_k[c] = n_k.

Two ways to split, from the sound to the hypothesis-driven:

- ``integer_bounds``: the least and greatest value of every ``x_k[c]`` over all integer
  solutions. The constraint matrix is that of a transportation problem (totally
  unimodular), so the bounds of the linear relaxation are attained at integer points and
  one LP per entry gives them exactly. A member is *determined* when its lower and upper
  bounds agree in every class: every feasible split then gives it the same counts.
- ``whole_class_splits``: the subset-sum search an attacker tries on non-IID data, where a
  class often lies with one member alone: every assignment of each class (its whole count)
  to one member that meets every member's size. One assignment alone is a *candidate* split;
  it is the truth only where the assumption holds, so records score it against the truth.

Pure numpy/scipy; ``disaggregate_attack.py`` applies them to a run's cohorts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from privfedcal.errors import UsageError

#: class-to-member assignments tried at most by the whole-class search (members^classes)
MAX_ASSIGNMENTS = 2**16


@dataclass(frozen=True)
class CohortSplit:
    """What the sizes say about one cohort: per-member integer bounds, whether each member
    is determined, and the whole-class candidate (None: none or several fit)."""

    members: tuple[int, ...]
    feasible: bool  # some integer split meets the sums and the sizes
    low: np.ndarray  # (m, C) least count of each member and class over feasible splits
    high: np.ndarray  # (m, C) greatest
    whole_class: np.ndarray | None  # (m, C) the one whole-class split, if exactly one fits
    whole_class_fits: int  # how many whole-class splits fit (capped search: see MAX_...)

    @property
    def determined(self) -> np.ndarray:
        """(m,) bool: every feasible integer split gives the member the same counts."""
        return self.feasible & (self.low == self.high).all(axis=1)

    @property
    def split(self) -> bool:
        """Whether the sizes split the cohort: a member determined, or one whole-class
        split alone fits."""
        return bool(self.determined.any()) or self.whole_class is not None


def _checked(sums: Sequence[float], sizes: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    s = np.rint(np.asarray(sums, dtype=np.float64)).astype(np.int64)
    n = np.rint(np.asarray(sizes, dtype=np.float64)).astype(np.int64)
    if s.ndim != 1 or n.ndim != 1 or n.size == 0:
        raise UsageError(f"a cohort split needs class sums (C,) and sizes (m,), got "
                         f"{s.shape} and {n.shape}")
    return s, n


def _consistent(s: np.ndarray, n: np.ndarray) -> bool:
    return bool((s >= 0).all() and (n >= 0).all() and s.sum() == n.sum())


def integer_bounds(sums: Sequence[float], sizes: Sequence[float]
                   ) -> tuple[bool, np.ndarray, np.ndarray]:
    """``(feasible, low, high)``: every member's least and greatest count per class over
    the non-negative integer splits of ``sums`` (C,) with member totals ``sizes`` (m,)."""
    s, n = _checked(sums, sizes)
    m, c = n.size, s.size
    low, high = np.zeros((m, c), dtype=np.int64), np.zeros((m, c), dtype=np.int64)
    if not _consistent(s, n):
        return False, low, high
    if m == 1:
        return True, s[None].copy(), s[None].copy()
    # variables x[k, c] row-major; equalities: each class's sum, each member's total
    a_eq = np.vstack([np.kron(np.ones(m), np.eye(c)), np.kron(np.eye(m), np.ones(c))])
    b_eq = np.concatenate([s, n]).astype(np.float64)
    bounds = [(0.0, float(s[j])) for _ in range(m) for j in range(c)]
    for i in range(m * c):
        for sign, out in ((1.0, low), (-1.0, high)):
            cost = np.zeros(m * c)
            cost[i] = sign
            res = linprog(cost, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
            if res.status != 0:
                return False, low, high
            out[i // c, i % c] = int(round(sign * res.fun))
    return True, low, high


def whole_class_splits(sums: Sequence[float], sizes: Sequence[float],
                       limit: int = MAX_ASSIGNMENTS) -> tuple[list[np.ndarray], bool]:
    """``(splits, complete)``: every assignment of each non-empty class, whole, to one
    member that meets every member's size, as (m, C) counts; ``complete`` False when more
    than ``limit`` assignments would have to be tried."""
    s, n = _checked(sums, sizes)
    m = n.size
    held = [j for j in range(s.size) if s[j] > 0]
    if not _consistent(s, n):
        return [], True
    if m ** len(held) > limit:
        return [], False
    out = []
    for owners in itertools.product(range(m), repeat=len(held)):
        x = np.zeros((m, s.size), dtype=np.int64)
        for j, k in zip(held, owners, strict=True):
            x[k, j] = s[j]
        if (x.sum(axis=1) == n).all():
            out.append(x)
    return out, True


def split_cohort(members: Sequence[int], sums: Sequence[float], sizes: Sequence[float]
                 ) -> CohortSplit:
    """Both splits of one cohort (``members`` in the order of ``sizes``)."""
    feasible, low, high = integer_bounds(sums, sizes)
    whole, _ = whole_class_splits(sums, sizes) if feasible else ([], True)
    return CohortSplit(tuple(int(k) for k in members), feasible, low, high,
                       whole[0] if len(whole) == 1 else None, len(whole))
