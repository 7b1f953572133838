"""Exact arithmetic for the harness's checks, written apart from the package's planner and
checker (privfedcal/privacy/cohorts.py, privfedcal/privacy/planner.py, privfedcal/privacy/): rational row
reduction to decide which groups of clients the released sums determine, and a bounded
enumeration of the non-negative integer splits of a group's counts.

A group G is determined by a set of linear equations over the clients' values when some
non-zero vector supported on G lies in the row space of the equations: that combination of
G's values is then known. For rows R (each the indicator of a sum's contributors) and the
unit vectors e_g of G, that happens exactly when rank(R) + |G| > rank(R stacked on e_G).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction
from itertools import combinations


def echelon(rows: Iterable[Sequence[int | Fraction]]) -> list[list[Fraction]]:
    """The non-zero rows of the reduced row echelon form of ``rows`` (Gauss-Jordan over the
    rationals: no rounding, so rank decisions are exact)."""
    basis: list[list[Fraction]] = []
    pivots: list[int] = []
    for raw in rows:
        row = [Fraction(x) for x in raw]
        for b, p in zip(basis, pivots, strict=True):  # eliminate the known pivots
            if row[p]:
                f = row[p]
                row = [x - f * y for x, y in zip(row, b, strict=True)]
        lead = next((i for i, x in enumerate(row) if x), None)
        if lead is None:
            continue
        row = [x / row[lead] for x in row]
        for i, b in enumerate(basis):  # keep the basis reduced
            if b[lead]:
                f = b[lead]
                basis[i] = [x - f * y for x, y in zip(b, row, strict=True)]
        basis.append(row)
        pivots.append(lead)
    return basis


def rank(rows: Iterable[Sequence[int | Fraction]]) -> int:
    return len(echelon(rows))


def unit(n: int, i: int) -> list[int]:
    return [int(j == i) for j in range(n)]


def group_determined(basis: list[list[Fraction]], group: Sequence[int], n: int) -> bool:
    """Whether a non-zero combination of ``group``'s values lies in the span of ``basis``
    (an echelon basis over ``n`` clients)."""
    return len(basis) + len(group) > rank([*basis, *(unit(n, g) for g in group)])


def determined_groups(rows: Sequence[Sequence[int]], n: int, below: int,
                      known: Sequence[int] = ()) -> list[tuple[int, ...]]:
    """Every minimal group of fewer than ``below`` clients (none of them in ``known``) of
    which some combination follows from ``rows`` and the values of the ``known`` clients
    (an observer's own): the groups the released sums single out."""
    basis = echelon([*rows, *(unit(n, k) for k in known)])
    others = [c for c in range(n) if c not in set(known)]
    found: list[tuple[int, ...]] = []
    for size in range(1, below):
        for group in combinations(others, size):
            if any(set(f) <= set(group) for f in found):
                continue  # a smaller group inside it is already reported
            if group_determined(basis, group, n):
                found.append(group)
    return found


def integer_splits(totals: Sequence[int], sizes: Sequence[int], limit: int = 2
                   ) -> list[list[list[int]]]:
    """The splits of per-class ``totals`` (one group's summed counts) into one non-negative
    integer count vector per member, member k's entries summing to ``sizes[k]``; at most
    ``limit`` of them (the caller asks whether the split is unique)."""
    found: list[list[list[int]]] = []

    def rows_for(k: int, left: list[int], done: list[list[int]]) -> None:
        if len(found) >= limit:
            return
        if k == len(sizes) - 1:
            if sum(left) == sizes[k]:
                found.append([*done, list(left)])
            return
        rest = sum(sizes[k + 1:])
        for row in vectors(left, sizes[k]):
            remaining = [a - b for a, b in zip(left, row, strict=True)]
            if sum(remaining) == rest:
                rows_for(k + 1, remaining, [*done, row])

    if sum(totals) == sum(sizes) and all(t >= 0 for t in totals):
        rows_for(0, list(totals), [])
    return found


def vectors(caps: Sequence[int], total: int) -> Iterable[list[int]]:
    """Every non-negative integer vector below ``caps`` entry-wise that sums to ``total``."""
    if not caps:
        if total == 0:
            yield []
        return
    room = sum(caps[1:])
    for first in range(max(0, total - room), min(caps[0], total) + 1):
        for tail in vectors(caps[1:], total - first):
            yield [first, *tail]


def combination(rows: Sequence[Sequence[int]], target: Sequence[int]
                ) -> list[Fraction] | None:
    """Coefficients c with sum_i c_i rows[i] == target, or None when ``target`` is not in
    the row space (exact: Gauss-Jordan on the transposed system with an identity beside)."""
    m = len(rows)
    # row-reduce [rows | I]; a zero left part leaves a relation on the right
    aug = [[Fraction(x) for x in r] + [Fraction(int(i == j)) for j in range(m)]
           for i, r in enumerate(rows)]
    aug.append([Fraction(-x) for x in target] + [Fraction(0)] * m)
    n = len(target)
    basis: list[list[Fraction]] = []
    for row in aug:
        for b in basis:
            lead = next(i for i, x in enumerate(b[:n]) if x)
            if row[lead]:
                f = row[lead] / b[lead]
                row = [x - f * y for x, y in zip(row, b, strict=True)]
        if any(row[:n]):
            basis.append(row)
    last = row  # the target's row, reduced: zero on the left when target is in the span
    if any(last[:n]):
        return None
    return list(last[n:])


def subset_splits(totals: Sequence[int], sizes: Sequence[int], limit: int = 2
                  ) -> list[list[int]]:
    """The ways to give each class of ``totals`` wholly to one member so that member k's
    classes sum to ``sizes[k]`` (at most ``limit``): the split an attacker who assumes
    clients share no class finds by subset-sum search. Each split: the owner of each class
    (-1 for an empty class)."""
    classes = [c for c, t in enumerate(totals) if t > 0]
    found: list[list[int]] = []

    def assign(i: int, left: list[int], owner: list[int]) -> None:
        if len(found) >= limit:
            return
        if i == len(classes):
            if not any(left):
                found.append(list(owner))
            return
        c = classes[i]
        for k in range(len(sizes)):
            if left[k] >= totals[c]:
                owner[c] = k
                left[k] -= totals[c]
                assign(i + 1, left, owner)
                left[k] += totals[c]
                owner[c] = -1

    if sum(totals) == sum(sizes):
        assign(0, list(sizes), [-1] * len(totals))
    return found
