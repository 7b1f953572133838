"""The harness's own solver against independent references: numpy's floating-point rank,
brute force over small integer problems, and hand-derived cases."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations, product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from .exact import combination, determined_groups, echelon, integer_splits, rank, subset_splits

rows_01 = st.integers(2, 6).flatmap(lambda n: st.lists(
    st.lists(st.integers(0, 1), min_size=n, max_size=n), min_size=1, max_size=7))


@settings(max_examples=60, deadline=None)
@given(rows_01)
def test_rank_is_numpys_on_small_zero_one_matrices(rows):
    assert rank(rows) == np.linalg.matrix_rank(np.array(rows, dtype=float))


@settings(max_examples=60, deadline=None)
@given(rows_01)
def test_determined_groups_match_the_projection_onto_the_row_space(rows):
    """Reference: e_G's span meets the row space iff stacking them drops numpy's rank."""
    a = np.array(rows, dtype=float)
    n = a.shape[1]
    r = np.linalg.matrix_rank(a)

    def hit(g):
        return np.linalg.matrix_rank(np.vstack([a, np.eye(n)[list(g)]])) < r + len(g)

    found = determined_groups(rows, n, 3)
    for g in combinations(range(n), 1):
        assert (g in found) == hit(g), (rows, g)
    for g in combinations(range(n), 2):  # minimal groups only: no member alone
        assert (g in found) == (hit(g) and not any(hit((c,)) for c in g)), (rows, g)


def test_a_lost_member_singles_itself_out():
    """Cohorts (0,1,2) and (3,4,5): a round with all six, a round without client 4 and the
    public total: client 4 is determined; with whole cohorts only, nothing is."""
    everyone, without_4 = [1] * 6, [1, 1, 1, 1, 0, 1]
    assert determined_groups([everyone, without_4], 6, 2) == [(4,)]
    assert determined_groups([everyone, [1, 1, 1, 0, 0, 0]], 6, 2) == []
    # the key holder (client 0) knows its own value: then (1, 2) together, not alone
    assert determined_groups([everyone, [1, 1, 1, 0, 0, 0]], 6, 3, known=(0,)) == [(1, 2)]


def test_combination_gives_the_coefficients_or_none():
    rows = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]]
    coef = combination(rows, [0, 0, 1, 1])
    assert coef is not None
    assert [sum(c * r[j] for c, r in zip(coef, rows, strict=True)) for j in range(4)] == \
        [0, 0, 1, 1]
    assert combination(rows, [1, 0, 0, 0]) is None
    assert echelon([[2, 4], [1, 2]]) == [[Fraction(1), Fraction(2)]]


def brute_splits(totals, sizes):
    """Every split of ``totals`` between two members, by enumeration."""
    out = []
    for a in product(*(range(t + 1) for t in totals)):
        b = [t - x for t, x in zip(totals, a, strict=True)]
        if sum(a) == sizes[0] and sum(b) == sizes[1]:
            out.append([list(a), b])
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(0, 16))
def test_integer_splits_are_those_of_brute_force(totals, first):
    sizes = [first, sum(totals) - first]
    if sizes[1] < 0:
        return
    want = brute_splits(totals, sizes)
    got = integer_splits(totals, sizes, limit=10**6)
    assert sorted(got) == sorted(want)


def test_subset_splits_give_whole_classes():
    # classes of 100, 50, 30 between members of 130 and 50: only {0, 2} | {1}
    assert subset_splits([100, 50, 0, 30], [130, 50]) == [[0, 1, -1, 0]]
    assert subset_splits([10, 10], [10, 10], limit=5) == [[0, 1], [1, 0]]  # ambiguous
    assert subset_splits([10, 10], [15, 5]) == []  # a class is shared
