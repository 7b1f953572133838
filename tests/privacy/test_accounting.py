"""Accountant over opacus and noise planning (privacy/accounting.py)."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from privfedcal.errors import PrivacyBudgetError, UsageError
from privfedcal.privacy import accounting
from privfedcal.privacy.accounting import (
    PrivacyAccountant,
    ReleasePlan,
    compute_epsilon,
    plan_noise,
)

DELTA = 1e-5


def opacus_eps(cls, steps: list[tuple[float, float]], delta: float = DELTA) -> float:
    """Reference: opacus's accountant stepped one release at a time, as DP-SGD would."""
    acc = cls()
    for z, q in steps:
        acc.step(noise_multiplier=z, sample_rate=q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return acc.get_epsilon(delta=delta)


def test_unknown_kind_lists_valid_ones():
    with pytest.raises(UsageError, match="rdp, prv"):
        PrivacyAccountant("gdp", DELTA)
    with pytest.raises(UsageError):
        PrivacyAccountant("rdp", 0.0)


# PRV with subsampling takes seconds per call, so its case keeps q = 1 (still heterogeneous).
@pytest.mark.parametrize("kind,cls,q", [("rdp", RDPAccountant, 0.3), ("prv", PRVAccountant, 1.0)])
def test_epsilon_matches_opacus_stepped_directly(kind, cls, q):
    acc = PrivacyAccountant(kind, DELTA)
    assert acc.epsilon() == 0.0
    # interleaved labels: CReFF rounds (q = participation) and a one-shot statistic (q = 1)
    acc.record(1.1, q, steps=3, label="creff-grad")
    acc.record(2.0, 1.0, label="ccvr-stats")
    acc.record(1.1, q, steps=2, label="creff-grad")
    ref = opacus_eps(cls, [(1.1, q)] * 3 + [(2.0, 1.0)] + [(1.1, q)] * 2)
    assert acc.epsilon() == pytest.approx(ref, rel=1e-9)
    assert len(acc) == 3 and [r["steps"] for r in acc.releases] == [3, 1, 2]


def test_record_merges_consecutive_equal_releases_and_epsilon_if_records_nothing():
    acc = PrivacyAccountant("rdp", DELTA)
    for _ in range(4):
        acc.record(1.5, 0.2, label="dp-sgd")
    assert acc.releases == [{"label": "dp-sgd", "noise_multiplier": 1.5, "sample_rate": 0.2,
                             "steps": 4}]
    before = acc.epsilon()
    after = acc.epsilon_if(1.5, 0.2, steps=6)
    assert acc.epsilon() == before and len(acc) == 1
    assert after == pytest.approx(opacus_eps(RDPAccountant, [(1.5, 0.2)] * 10), rel=1e-9)
    assert after > before


def test_state_dict_round_trips_through_json_exactly():
    acc = PrivacyAccountant("rdp", 2e-6)
    acc.record(0.9, 0.25, steps=7, label="creff-grad")
    acc.record(3.0, 1.0, label="ccvr-stats")
    state = json.loads(json.dumps(acc.state_dict()))
    again = PrivacyAccountant("rdp", 2e-6)
    again.load_state_dict(state)
    assert again.epsilon() == acc.epsilon() and again.releases == acc.releases
    with pytest.raises(UsageError, match="differs"):
        PrivacyAccountant("prv", 2e-6).load_state_dict(state)
    with pytest.raises(UsageError, match="differs"):
        PrivacyAccountant("rdp", 1e-5).load_state_dict(state)


def test_check_release_guards_the_budget():
    acc = PrivacyAccountant("rdp", DELTA)
    acc.record(1.0, 1.0, label="ccvr-stats")
    spent = acc.epsilon()
    eps = acc.check_release(1.0, 1.0, target=100.0)
    assert eps > spent and len(acc) == 1
    with pytest.raises(PrivacyBudgetError, match="budget"):
        acc.check_release(1.0, 1.0, target=spent + 0.01)


def test_prv_is_tighter_than_rdp_for_one_shot_statistics():
    # CCVR: one release, no subsampling
    rdp = compute_epsilon([(2.0, 1.0, 1)], "rdp", DELTA)
    prv = compute_epsilon([(2.0, 1.0, 1)], "prv", DELTA)
    assert rdp == pytest.approx(opacus_eps(RDPAccountant, [(2.0, 1.0)]), rel=1e-9)
    assert prv == pytest.approx(opacus_eps(PRVAccountant, [(2.0, 1.0)]), rel=1e-9)
    assert prv < 0.95 * rdp


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")  # opacus internals
@pytest.mark.parametrize("kind,q,steps,target", [("rdp", 0.02, 50, 2.0), ("rdp", 1.0, 1, 2.0),
                                                 ("prv", 1.0, 1, 2.0)])
def test_planned_sigma_meets_target_tightly_and_agrees_with_opacus(kind, q, steps, target):
    (z,) = plan_noise(target, DELTA, [ReleasePlan("uploads", q, steps)], kind)
    assert compute_epsilon([(z, q, steps)], kind, DELTA) <= target
    assert compute_epsilon([(0.98 * z, q, steps)], kind, DELTA) > target        # tight
    ref = get_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=q,
                               steps=steps, accountant=kind, epsilon_tolerance=0.01)
    # opacus stops within 0.01 of the target on the feasible side: its sigma is >= ours
    assert z <= ref * 1.001 and z == pytest.approx(ref, rel=0.02)


def test_two_groups_dpsgd_share_then_uploads_take_the_rest():
    target = 6.0
    plans = [ReleasePlan("dp-sgd", 0.02, 40, share=0.5), ReleasePlan("creff-grad", 0.1, 4),
             ReleasePlan("ccvr-stats", 1.0, 1)]
    z_sgd, z_up, z_up2 = plan_noise(target, DELTA, plans)
    assert z_up == z_up2
    (alone,) = plan_noise(0.5 * target, DELTA, [ReleasePlan("dp-sgd", 0.02, 40)])
    assert z_sgd == alone
    hist = [(z_sgd, 0.02, 40), (z_up, 0.1, 4), (z_up, 1.0, 1)]
    assert compute_epsilon(hist, "rdp", DELTA) <= target
    hist[1:] = [(0.98 * z_up, 0.1, 4), (0.98 * z_up, 1.0, 1)]
    assert compute_epsilon(hist, "rdp", DELTA) > target


def test_impossible_budget_refuses_to_start():
    # RDP at delta 1e-5 cannot certify less than ~0.1 whatever the noise
    with pytest.raises(PrivacyBudgetError, match="no noise multiplier"):
        plan_noise(0.05, DELTA, [ReleasePlan("uploads", 1.0, 1)])
    with pytest.raises(UsageError, match="leave nothing"):
        plan_noise(1.0, DELTA, [ReleasePlan("a", 1.0, share=0.6), ReleasePlan("b", 1.0, share=0.4),
                                ReleasePlan("c", 1.0)])
    with pytest.raises(UsageError):
        ReleasePlan("bad", 0.0)


@settings(max_examples=8, deadline=None)
@given(target=st.floats(0.5, 20.0),
       plans=st.lists(st.tuples(st.sampled_from([0.02, 1.0]), st.integers(1, 30)),
                      min_size=1, max_size=3),
       sgd=st.one_of(st.none(), st.tuples(st.just(0.02), st.integers(1, 30),
                                          st.sampled_from([0.3, 0.7]))))
def test_recording_a_plan_never_exceeds_the_target(target, plans, sgd):
    releases = [ReleasePlan(f"u{i}", q, t) for i, (q, t) in enumerate(plans)]
    if sgd is not None:
        releases.append(ReleasePlan("dp-sgd", sgd[0], sgd[1], share=sgd[2]))
    try:
        sigmas = plan_noise(target, DELTA, releases)
    except PrivacyBudgetError:
        return
    acc = PrivacyAccountant("rdp", DELTA)
    # record in an order other than the plan's, one step at a time, guarding each release
    for plan, z in reversed(list(zip(releases, sigmas, strict=True))):
        for _ in range(plan.steps):
            acc.check_release(z, plan.sample_rate, target=target)
            acc.record(z, plan.sample_rate, label=plan.name)
    assert acc.epsilon() <= target


@pytest.fixture
def fresh_adapter():
    """Re-run the opacus conformance check inside the test (and again after it)."""
    accounting._adapter.cache_clear()
    accounting._rdp_curve.cache_clear()
    yield
    accounting._adapter.cache_clear()
    accounting._rdp_curve.cache_clear()


def test_adapter_accepts_the_installed_opacus(fresh_adapter):
    import opacus

    assert ".".join(opacus.__version__.split(".")[:2]) in accounting.OPACUS_TESTED
    compute_rdp, get_privacy_spent, orders = accounting._adapter()
    assert orders == tuple(RDPAccountant.DEFAULT_ALPHAS)
    # the cached composition equals opacus's accountant on a heterogeneous history
    hist = [(0.9, 0.3, 5), (2.5, 1.0, 1), (0.9, 0.3, 2)]
    ref = opacus_eps(RDPAccountant, [(0.9, 0.3)] * 5 + [(2.5, 1.0)] + [(0.9, 0.3)] * 2)
    assert compute_epsilon(hist, "rdp", DELTA) == pytest.approx(ref, rel=1e-12)


def test_adapter_fails_loudly_when_opacus_changes_its_rdp(fresh_adapter, monkeypatch):
    # e.g. a release whose accountant no longer composes the analysis functions it exports
    real = RDPAccountant.get_epsilon
    monkeypatch.setattr(RDPAccountant, "get_epsilon", lambda self, delta, **kw:
                        real(self, delta, **kw) * 1.01)
    with pytest.raises(accounting.OpacusMismatch, match=r"^opacus [0-9.]+ does not match") as e:
        compute_epsilon([(1.0, 1.0, 1)], "rdp", DELTA)
    assert "\n" not in str(e.value) and "1.6" in str(e.value)
    # a UsageError (one line, exit 2 at the CLI), never taken for an infeasible budget
    assert isinstance(e.value, UsageError) and not isinstance(e.value, PrivacyBudgetError)


def test_adapter_fails_loudly_when_the_history_form_changes(fresh_adapter, monkeypatch):
    from opacus.accountants import PRVAccountant as Prv

    real = Prv.state_dict

    def as_dicts(self, destination=None):
        state = real(self, destination)
        state["history"] = [{"z": z, "q": q, "steps": t} for z, q, t in state["history"]]
        return state

    monkeypatch.setattr(Prv, "state_dict", as_dicts)
    with pytest.raises(accounting.OpacusMismatch, match="prv accountant's history"):
        compute_epsilon([(1.0, 1.0, 1)], "prv", DELTA)
