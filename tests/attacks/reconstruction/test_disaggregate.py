"""The disaggregation least squares (attacks/reconstruction/disaggregate.py): pinned against numpy on a
hand-built participation matrix, and, for random ones, exact whenever e_i is in the row
space and reported undetermined otherwise (the null space from scipy, independently)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import null_space

from privfedcal.attacks.reconstruction import disaggregate as D
from privfedcal.errors import UsageError

#: the participant sets of `train --clients 4 --participation 0.5 --rounds 6` (seed 0)
ROUNDS = [(0, 3), (0, 2), (0, 3), (2, 3), (2, 3), (0, 3)]


def matrix(sets, k: int) -> np.ndarray:
    a = np.zeros((len(sets), k))
    for i, s in enumerate(sets):
        a[i, list(s)] = 1.0
    return a


def test_least_squares_matches_numpy_on_a_hand_built_matrix():
    a = matrix(ROUNDS, 4)
    x = np.array([[2, 0, 44, 133], [118, 0, 13, 0], [0, 136, 71, 3], [13, 0, 5, 1]], float)
    y = a @ x
    sol = D.solve(a, y)
    np.testing.assert_allclose(sol.values, np.linalg.pinv(a) @ y, atol=1e-9)
    np.testing.assert_allclose(sol.values, np.linalg.lstsq(a, y, rcond=None)[0], atol=1e-9)
    # rows {0,3}, {0,2}, {2,3} fix clients 0, 2, 3; client 1 is in no sum
    assert sol.determined.tolist() == [True, False, True, True] and sol.rank == 3
    np.testing.assert_allclose(sol.values[[0, 2, 3]], x[[0, 2, 3]], atol=1e-9)
    np.testing.assert_allclose(sol.values[1], 0.0, atol=1e-9)  # minimum norm: nothing known
    # by hand: x0 = (s03 + s02 - s23) / 2 from rounds 1, 2 and 4
    np.testing.assert_allclose(sol.values[0], (y[0] + y[1] - y[3]) / 2, atol=1e-9)
    assert D.finest_groups(a) == ([(0,), (2,), (3,)], True)
    # the public total (a row of ones) gives the never-selected client as N minus the rest
    total = np.vstack([a, np.ones(4)])
    full = D.solve(total, np.vstack([y, x.sum(0)]))
    assert full.determined.all() and full.residual < 1e-12
    np.testing.assert_allclose(full.values, x, atol=1e-9)
    assert D.finest_groups(total)[0] == [(0,), (1,), (2,), (3,)]


def test_finest_groups_overlap_or_follow_cohorts():
    # two sums over {0,1} and {1,2}: no client alone, both pairs, not the three together
    assert D.finest_groups(matrix([(0, 1), (1, 2)], 3)) == ([(0, 1), (1, 2)], True)
    assert not D.determined(matrix([(0, 1), (1, 2)], 3)).any()
    # cohorts {0,1}, {2,3}, {4,5} selected whole, plus the public total: nothing finer
    a = np.vstack([matrix([(0, 1), (2, 3), (0, 1, 4, 5), (2, 3, 4, 5)], 6), np.ones(6)])
    assert D.finest_groups(a) == ([(0, 1), (2, 3), (4, 5)], True)
    assert not D.determined(a).any()
    assert D.atoms(a) == [(0, 1), (2, 3), (4, 5)]
    assert D.group_of([(0, 1), (0, 1, 2)], 1) == (0, 1) and D.group_of([(0, 1)], 2) is None
    # the search budget is reported when it runs out
    assert D.finest_groups(matrix([(0, 1), (1, 2)], 3), max_subsets=0) == ([], False)


def test_windows_recover_values_constant_within_each_window():
    a = matrix(ROUNDS * 2, 4)[:, [0, 2, 3]]  # the three clients ever selected
    x1, x2 = np.array([[1.0], [2.0], [3.0]]), np.array([[5.0], [-1.0], [0.5]])
    y = np.vstack([a[:6] @ x1, a[6:] @ x2])
    first, second = D.solve_windows(a, y, 6)
    np.testing.assert_allclose(first.values, x1, atol=1e-9)
    np.testing.assert_allclose(second.values, x2, atol=1e-9)
    (whole,) = D.solve_windows(a, y, 0)  # one window: the time average, with a residual
    assert whole.residual > 0.1
    assert D.windows(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(UsageError, match="--window"):
        D.windows([1], -1)


def test_bad_input_is_refused():
    with pytest.raises(UsageError, match="participation rows"):
        D.solve(np.ones((2, 3)), np.ones((3, 1)))
    with pytest.raises(UsageError, match="2-D"):
        D.solve(np.ones(3), np.ones(3))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8).flatmap(lambda r: st.tuples(
    st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=r, max_size=r),
    st.lists(st.integers(-50, 500), min_size=10, max_size=10),
    st.booleans())))
def test_recovered_values_are_exact_exactly_when_determined(case):
    rows, values, total = case
    a = np.asarray(rows, dtype=np.float64)
    if total:
        a = np.vstack([a, np.ones(5)])
    x = np.asarray(values, dtype=np.float64).reshape(5, 2)
    sol = D.solve(a, a @ x)
    ns = null_space(a) if a.any() else np.eye(5)
    for i in range(5):
        moved = ns.size and np.abs(ns[i]).max() > 1e-9
        # undetermined: some X' = X + n (A n = 0) fits the sums as well and moves x_i
        assert bool(sol.determined[i]) == (not moved)
        if sol.determined[i]:
            np.testing.assert_allclose(sol.values[i], x[i], atol=1e-6)
    # every finest group's sum is determined, and no smaller part of it is
    groups, complete = D.finest_groups(a)
    assert complete
    for g in groups:
        ind = np.zeros(5)
        ind[list(g)] = 1
        assert not ns.size or np.abs(ind @ ns).max() < 1e-9
        np.testing.assert_allclose(ind @ sol.values, ind @ x, atol=1e-6)
        for size in range(1, len(g)):
            for part in itertools.combinations(g, size):
                sub = np.zeros(5)
                sub[list(part)] = 1
                assert np.abs(sub @ ns).max() > 1e-9
