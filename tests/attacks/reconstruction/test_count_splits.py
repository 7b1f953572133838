"""Splitting a cohort's summed class counts with its members' sizes, on hand-built cohorts
whose answer is worked out by hand in each test's docstring."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from privfedcal.attacks.reconstruction.count_splits import (
    integer_bounds,
    split_cohort,
    whole_class_splits,
)
from privfedcal.attacks.reconstruction.disaggregate_attack import clear_sizes, cohort_splits


def test_sizes_matching_one_assignment_of_whole_classes_split_the_cohort():
    """n = (3, 5), sums (3, 5): class 0 to the first member and class 1 to the second is the
    one whole-class assignment (the other gives sizes (5, 3)); integer splits do not agree
    (the first member may hold (3,0), (2,1), (1,2) or (0,3))."""
    cut = split_cohort([4, 7], [3, 5], [3, 5])
    assert cut.feasible and cut.split
    assert cut.whole_class.tolist() == [[3, 0], [0, 5]]
    assert not cut.determined.any()
    assert cut.low[0].tolist() == [0, 0] and cut.high[0].tolist() == [3, 3]


def test_an_ambiguous_cohort_is_not_split():
    """n = (2, 2), sums (2, 2): both whole-class assignments fit, and the integer bounds of
    every entry are 0..2."""
    cut = split_cohort([0, 1], [2, 2], [2, 2])
    assert cut.feasible and not cut.split
    assert cut.whole_class is None and cut.whole_class_fits == 2
    assert cut.low.tolist() == [[0, 0], [0, 0]] and cut.high.tolist() == [[2, 2], [2, 2]]


def test_integer_bounds_determine_a_member_every_split_agrees_on():
    """n = (0, 8): the first member holds nothing, so the second holds all of (3, 5). With
    three members and n = (4, 1, 3) over sums (4, 0, 4), the bounds of member 0 class 0 are
    max(0, 4 - 4) = 0 .. min(4, 4) = 4 (the transportation bounds)."""
    cut = split_cohort([0, 1], [3, 5], [0, 8])
    assert cut.determined.tolist() == [True, True]
    assert cut.low.tolist() == [[0, 0], [3, 5]]
    feasible, low, high = integer_bounds([4, 0, 4], [4, 1, 3])
    assert feasible and low[0, 0] == 0 and high[0, 0] == 4 and high[1, 0] == 1


def test_weights_that_are_not_sizes_split_nothing():
    """Uniform nominal weights (1, 1) do not add up to the cohort's 8 counts: infeasible."""
    cut = split_cohort([0, 1], [3, 5], [1, 1])
    assert not cut.feasible and not cut.split
    assert whole_class_splits([3, 5], [1, 1]) == ([], True)


def test_a_runs_groups_are_split_with_the_clear_sizes():
    """Clients 0..3 in cohorts (0, 1) and (2, 3), values the least-squares estimates whose
    group sums are determined (each member's own row is not): (0, 1) sums to (3, 5) with
    sizes (3, 5), split; (2, 3) sums to (2, 2) with sizes (2, 2), not split. The last
    member's size follows from the others' and the group's total."""
    values = np.array([[1.5, 2.5], [1.5, 2.5], [1.0, 1.0], [1.0, 1.0]])
    got = cohort_splits([(0, 1), (2, 3)], values, {0: 3.0, 1: 5.0, 2: 2.0, 3: 2.0})
    assert got[0]["split"] == "whole-class" and got[0]["split_value"] == [3, 0]
    assert got[1]["split_value"] == [0, 5]
    assert got[2]["split"] is None and got[3]["split"] is None
    # one size unknown: the group's count total minus the other's (8 - 3 = 5)
    assert cohort_splits([(0, 1)], values, {0: 3.0})[1]["size"] == 5.0
    assert cohort_splits([(0, 1)], values, {}) == {}  # no size: no split


def _update(client: int, round_: int, weight: float) -> dict:
    return {"label": "model-update", "view": "plain-upload", "client": client,
            "round": round_, "weight": weight}


def test_clear_weights_are_sizes_only_when_they_differ_and_stay_the_same():
    """Weights (3, 5) in two rounds are sizes; a client whose weight changes has none;
    one weight for every client (uniform nominal weights) gives none at all."""
    view = SimpleNamespace(entries=[_update(0, 1, 3.0), _update(1, 1, 5.0), _update(0, 2, 3.0),
                                    _update(2, 1, 4.0), _update(2, 2, 6.0)])
    assert clear_sizes(view) == {0: 3.0, 1: 5.0}
    view = SimpleNamespace(entries=[_update(k, 1, 1.0) for k in range(4)])
    assert clear_sizes(view) == {}
