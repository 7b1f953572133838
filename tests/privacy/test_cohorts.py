"""Fixed cohorts and the whole-run checker (privfedcal/privacy/cohorts.py): what every combination
of a run's secure sums isolates, checked against an independent rank computation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.errors import UsageError
from privfedcal.privacy import cohorts
from privfedcal.privacy.cohorts import (
    CohortPlan,
    check_schedule,
    cohort_groups,
    cohort_plan,
    cohort_size,
    complete_cohorts,
    isolated_group,
    make_cohorts,
    select_clients,
    whole_cohorts,
)
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.settings.run_config import RunConfig


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", clients=10, rounds=6, participation=0.5, seed=0,
                device="cpu")
    return RunConfig.of(**{**base, **kw})


def brute_force_isolated(rows, n, m, public_total=True, known=()) -> set[tuple[int, ...]]:
    """Every group G of fewer than m clients (outside ``known``) that a vector of the row
    space isolates, by ranks (no singular values): with the known clients' coordinates free,
    the span is that of the rows restricted to the other clients, and it holds a non-zero
    vector supported on G iff dropping G's columns lowers its rank."""
    mat = np.zeros((len(rows) + int(public_total), n))
    for i, row in enumerate(rows):
        mat[i, list(row)] = 1
    if public_total:
        mat[-1] = 1
    others = [c for c in range(n) if c not in known]
    keep = mat[:, others]
    rank = np.linalg.matrix_rank(keep)
    found = set()
    for size in range(1, m):
        for group in itertools.combinations(range(len(others)), size):
            rest = keep[:, [j for j in range(len(others)) if j not in group]]
            if (np.linalg.matrix_rank(rest) if rest.size else 0) < rank:
                found.add(tuple(others[j] for j in group))
    return found


def test_isolated_group_on_hand_worked_schedules():
    # {0,1} and {1,2} with the public total {0,1,2}: total - {1,2} = e0 isolates client 0
    # (and total - {0,1} client 2); the first found is reported
    assert isolated_group([{0, 1}, {1, 2}], 3, 2).group == (0,)
    # without a public total no single client is determined ...
    assert isolated_group([{0, 1}, {1, 2}], 3, 2, public_total=False) is None
    # ... but with m = 3 a sum of two is itself too small, and so is the difference
    # (1, 0, -1) of the two sums, supported on {0, 2}
    assert isolated_group([{0, 1}, {1, 2}], 3, 3, public_total=False).group == (0, 1)
    assert isolated_group([{0, 1}, {1, 2}, {0, 1, 2}], 3, 3, public_total=False).group == (0,)
    assert isolated_group([{0, 1, 2, 3}, {1, 2, 3}], 4, 3, public_total=False).group == (0,)
    # the leak of a plain partial-participation schedule: 4 clients, 2 a round
    leak = [{0, 3}, {0, 2}, {1, 3}, {0, 1}, {2, 3}, {1, 2}]
    assert isolated_group(leak, 4, 2) is not None
    # whole cohorts {0,3} and {1,2}: nothing finer than a cohort
    assert isolated_group([{0, 3}, {1, 2}, {0, 3}, {0, 1, 2, 3}], 4, 2) is None
    # the key holder knows its own value: a sum {kh, a} isolates a
    assert isolated_group([{0, 1, 2, 3}], 4, 2, public_total=False, known=(0,)) is None
    assert isolated_group([{0, 1}, {2, 3}], 4, 2, public_total=False, known=(0,)).group == (1,)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 7), m=st.integers(2, 4), data=st.data())
def test_exact_check_matches_an_independent_rank_computation(n, m, data):
    rows = data.draw(st.lists(st.sets(st.integers(0, n - 1), min_size=1), min_size=1,
                              max_size=8))
    public = data.draw(st.booleans())
    expected = brute_force_isolated(rows, n, m, public)
    found = isolated_group(rows, n, m, public_total=public)
    assert (found is None) == (not expected)
    if found is not None:
        assert found.exact and found.group in expected


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 8), m=st.integers(2, 4), data=st.data())
def test_conservative_check_never_passes_what_the_exact_one_refuses(n, m, data):
    rows = data.draw(st.lists(st.sets(st.integers(0, n - 1), min_size=1), min_size=1,
                              max_size=8))
    exact = isolated_group(rows, n, m)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cohorts, "EXACT_LIMIT", 0)
        conservative = isolated_group(rows, n, m)
    if exact is not None:
        assert conservative is not None and not conservative.exact


def test_cohorts_partition_the_clients_and_follow_the_public_seed():
    groups = make_cohorts(11, 3, seed=5)
    assert sorted(c for g in groups for c in g) == list(range(11))
    assert [len(g) for g in groups].count(4) == 2 and min(len(g) for g in groups) == 3
    assert make_cohorts(11, 3, seed=5) == groups != make_cohorts(11, 3, seed=6)


@pytest.mark.parametrize(("clients", "asked", "m", "size"),
                         [(4, 2, 2, 2), (20, 8, 2, 2), (10, 5, 2, 5), (10, 10, 2, 2),
                          (10, 6, 3, 3), (7, 3, 2, 3)])
def test_cohort_size_divides_a_round(clients, asked, m, size):
    assert cohort_size(clients, asked, m) == size


def test_cohort_size_refuses_rounds_below_the_minimum():
    with pytest.raises(UsageError, match="fewer than --secagg-min-clients 3"):
        cohort_size(10, 2, 3)


def test_plain_selection_is_unchanged_and_secure_selection_takes_whole_cohorts():
    plain = _cfg(participation=0.3)
    assert select_clients(PrivacyOptions.of(plain), 1) == [1, 2, 6]  # the plain draw (tests/federation)
    secure = _cfg(clients=20, participation=0.4, secagg_updates=True, method="fedavg")
    plan = cohort_plan(PrivacyOptions.of(secure))
    assert plan.smallest == 2 and plan.per_round == 4
    for r in range(1, 7):
        chosen = set(select_clients(PrivacyOptions.of(secure), r))
        assert len(chosen) == 8
        assert all(set(g) <= chosen or not set(g) & chosen for g in plan.cohorts)
    assert len({tuple(select_clients(PrivacyOptions.of(secure), r)) for r in range(1, 7)}) > 1


def test_planned_schedule_of_secure_runs_isolates_no_client_and_plain_selection_would():
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.planner import protection_inputs, secure_schedule

    for cfg in (_cfg(clients=4, method="creff", secagg=True, hide_counts=True),
                _cfg(clients=4, method="fedavg", secagg_updates=True),
                _cfg(clients=20, participation=0.4, method="creff", secagg=True,
                     hide_counts=True)):
        rows = secure_schedule(protection_inputs(PrivacyOptions.of(cfg), calibrator_class(cfg)))
        check_schedule(rows, cfg.data.clients, cfg.privacy.secagg_min_clients)
    # mutation: the same schedule drawn client by client (no cohorts) is refused
    cfg = _cfg(clients=4, method="creff", secagg=True, hide_counts=True)
    plain = [select_clients(PrivacyOptions.of(cfg.replace(secagg=False, hide_counts=False)), r)
             for r in range(1, 7)]
    with pytest.raises(UsageError, match="isolate"):
        check_schedule(plain, 4, 2)


def test_a_missing_upload_takes_its_cohort_out_of_the_sum():
    groups = ((0, 3), (1, 2), (4, 5, 6))
    assert complete_cohorts([0, 3, 1, 4, 5, 6], groups) == {0, 3, 4, 5, 6}
    assert complete_cohorts([0, 3], groups) == {0, 3}
    assert complete_cohorts([0, 1], None) == {0, 1}
    # a member that was not asked (a node lost in training) takes its cohort out as well:
    # never "whole as far as it was asked"
    assert complete_cohorts([0, 3, 4, 6], groups) == {0, 3}
    assert cohort_groups([0, 3, 4, 6], groups) == ([[0, 3]], [4, 6])


def test_the_key_holders_rule_is_whole_public_cohorts():
    groups = ((0, 3), (1, 2), (4, 5, 6))
    assert whole_cohorts([0, 3, 4, 5, 6], groups) and whole_cohorts([2, 1], groups)
    assert not whole_cohorts([4, 6], groups)  # cohort (4, 5, 6) less a lost member
    assert not whole_cohorts([0, 3, 3], groups)  # a client twice
    assert whole_cohorts([4, 6], None)


def test_cohort_plan_record():
    plan = CohortPlan(((0, 1), (2, 3, 4)), 1)
    assert plan.to_dict() == {"cohorts": [[0, 1], [2, 3, 4]], "per_round": 1, "smallest": 2}
    assert plan.members() == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}
