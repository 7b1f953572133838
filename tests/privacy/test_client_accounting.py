"""Accounting that matches who knows what: per client, q = 1 over the rounds it is selected
in (the server picks the clients from the public seed, so their sampling amplifies nothing)."""

from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from privfedcal.calibration.creff import CREFF_RELEASE, CReFF
from privfedcal.errors import PrivacyBudgetError
from privfedcal.experiment import build_experiment, calibrator_class
from privfedcal.privacy.accounting import PrivacyAccountant
from privfedcal.privacy.cohorts import select_clients
from privfedcal.privacy.planner import (
    DPAccounting,
    build_uplink,
    participation_counts,
    protection_inputs,
    release_plans,
)
from privfedcal.privacy.stages import NoiseStage
from privfedcal.settings.floors import PrivacyOptions


def opacus_eps(z, q, steps, delta):
    acc = RDPAccountant()
    acc.history = [(z, q, steps)]
    return acc.get_epsilon(delta=delta)


def stage(z=2.0, target=100.0):
    return DPAccounting(target=target, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                   sigmas={CREFF_RELEASE: z}, rates={CREFF_RELEASE: 1.0}, clip=1.0,
                   grad_clip=1.0, distributed=False, covers_updates=False)


def test_participation_counts_follow_the_public_selection(tiny_cfg):
    cfg = tiny_cfg(clients=10, participation=0.4, rounds=20)
    counts = participation_counts(PrivacyOptions.of(cfg))
    manual = dict.fromkeys(range(10), 0)
    for r in range(1, 21):
        for c in select_clients(PrivacyOptions.of(cfg), r):
            manual[c] += 1
    assert counts == manual and sum(counts.values()) == 20 * 4


def test_creff_plan_has_no_amplification_from_server_sampling(tiny_cfg):
    cfg = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=20)
    (plan,) = release_plans(protection_inputs(PrivacyOptions.of(cfg), calibrator_class(cfg)))
    assert plan.sample_rate == 1.0
    assert plan.steps == max(participation_counts(PrivacyOptions.of(cfg)).values())


def test_planned_noise_meets_the_budget_without_amplification(tiny_cfg):
    cfg = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=20, dp_eps=8.0)
    up = build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg))
    dp = up.find(NoiseStage).dp
    z, delta = dp.sigmas[CREFF_RELEASE], dp.delta
    assert CReFF.release_rounds(PrivacyOptions.of(cfg)) == tuple(range(1, 21))
    t_max = max(participation_counts(PrivacyOptions.of(cfg)).values())
    assert dp.rates[CREFF_RELEASE] == 1.0
    assert opacus_eps(z, 1.0, t_max, delta) <= 8.0
    assert opacus_eps(z * 0.99, 1.0, t_max, delta) > 8.0  # the smallest such noise (1e-3)
    # the old amplified accounting (q = 0.4 over all rounds) would claim far less epsilon
    assert opacus_eps(z, 0.4, 20, delta) < 0.8 * opacus_eps(z, 1.0, t_max, delta)


def test_each_client_composes_only_its_own_releases():
    dp = stage(z=2.0)
    dp.record(CREFF_RELEASE, [0, 1])
    dp.record(CREFF_RELEASE, [0])
    dp.record(CREFF_RELEASE, [0, 2])
    eps = {c: a.epsilon() for c, a in dp.per_client.items()}
    assert eps[0] == pytest.approx(opacus_eps(2.0, 1.0, 3, 1e-5))
    assert eps[1] == pytest.approx(opacus_eps(2.0, 1.0, 1, 1e-5))
    assert eps[2] == pytest.approx(eps[1])
    assert dp.epsilon() == pytest.approx(eps[0])
    assert dp.summary()["per_client_epsilon"]["1"] == pytest.approx(eps[1])


def test_summary_counts_the_clients_per_epsilon_and_lists_them_up_to_a_limit(monkeypatch):
    from privfedcal.privacy import dp_accounting

    dp = stage(z=2.0)
    dp.record(CREFF_RELEASE, [0, 1, 2])
    dp.record(CREFF_RELEASE, [0])
    summary = dp.summary()
    counts = [(float(e), n) for e, n in summary["epsilon_clients"].items()]
    assert [n for _, n in counts] == [1, 2]  # client 0 twice, clients 1 and 2 once
    assert counts[0][0] == pytest.approx(opacus_eps(2.0, 1.0, 2, 1e-5))
    assert counts[1][0] == pytest.approx(opacus_eps(2.0, 1.0, 1, 1e-5))
    assert summary["per_client_epsilon"] == {"0": counts[0][0], "1": counts[1][0],
                                             "2": counts[1][0]}
    monkeypatch.setattr(dp_accounting, "LISTED_CLIENTS", 2)  # more clients than listed: counts only
    summary = dp.summary()
    assert "per_client_epsilon" not in summary and sum(summary["epsilon_clients"].values()) == 3


def test_budget_guard_is_per_client():
    z = 2.0
    two = opacus_eps(z, 1.0, 2, 1e-5)
    dp = stage(z=z, target=two * 1.001)
    dp.check(CREFF_RELEASE, [0, 1])
    dp.record(CREFF_RELEASE, [0, 1])
    dp.record(CREFF_RELEASE, [0])
    dp.check(CREFF_RELEASE, [1, 2])  # clients 1 and 2 still have room
    with pytest.raises(PrivacyBudgetError):
        dp.check(CREFF_RELEASE, [0, 2])  # client 0 would take a third release


def test_per_client_state_survives_resume():
    dp = stage()
    dp.record(CREFF_RELEASE, [0, 3])
    dp.record(CREFF_RELEASE, [3])
    fresh = stage()
    fresh.load_state_dict(dp.state_dict())
    assert fresh.epsilon() == pytest.approx(dp.epsilon())
    assert set(fresh.per_client) == {0, 3}


@pytest.mark.parametrize("last", [None, 10])
def test_creff_plan_counts_the_releases_of_its_schedule(tiny_cfg, last):
    """The digits defaults (10 clients, 30 rounds, full participation) under --dp-eps 8:
    CReFF releases every round (30 releases per client, the default) or, with
    --creff-release-last 10, in rounds 21-30 only (10). The plan has that many releases per
    client at q = 1, its noise multiplier is the smallest that opacus's RDP accountant,
    called directly, accepts for them, and each client's ledger allows that many."""
    params = {} if last is None else {"creff_release_last": last}
    cfg = tiny_cfg(method="creff", clients=10, alpha=0.1, rounds=30, dp_eps=8.0,
                   calibration_params=params)
    assert cfg.training.participation == 1.0
    releases = 30 if last is None else last
    assert len(CReFF.release_rounds(PrivacyOptions.of(cfg))) == releases
    (plan,) = release_plans(protection_inputs(PrivacyOptions.of(cfg), calibrator_class(cfg)))
    assert (plan.name, plan.sample_rate, plan.steps) == (CREFF_RELEASE, 1.0, releases)
    dp = build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg)) \
        .find(NoiseStage).dp
    z, delta = dp.sigmas[CREFF_RELEASE], dp.delta
    assert delta == 1e-5
    assert opacus_eps(z, 1.0, releases, delta) <= 8.0
    assert opacus_eps(z * 0.99, 1.0, releases, delta) > 8.0
    assert z == pytest.approx({None: 3.494, 10: 2.018}[last], abs=2e-3)
    assert dp.ledger(0).limits == {CREFF_RELEASE: releases}


def test_partial_participation_counts_selections_within_the_release_rounds(tiny_cfg):
    part = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=12, dp_eps=8.0,
                    calibration_params={"creff_release_last": 5})
    (plan,) = release_plans(protection_inputs(PrivacyOptions.of(part), calibrator_class(part)))
    manual = dict.fromkeys(range(10), 0)
    for r in range(8, 13):
        for c in select_clients(PrivacyOptions.of(part), r):
            manual[c] += 1
    assert plan.steps == max(manual.values()) < max(participation_counts(PrivacyOptions.of(part)).values())


def test_a_run_charges_each_release_of_its_schedule(tiny_cfg, tmp_path):
    """4 rounds, the last 2 release: each client is charged (server accountant and its own
    ledger) twice, at the planned noise, and the summary names the release rounds."""
    from privfedcal.experiment import build_simulator

    run = tiny_cfg(method="creff", rounds=4, dp_eps=8.0, calibration_params={
        "creff_release_last": 2, "features_per_class": 5, "match_steps": 2,
        "retrain_steps": 5})
    sim = build_simulator(run.replace(out=str(tmp_path / "r")), tmp_path / "r")
    summary = sim.run()
    dp = sim.uplink.find(NoiseStage).dp
    assert [(r["label"], r["steps"]) for r in dp.accountant.releases] == [(CREFF_RELEASE, 2)]
    assert summary["creff_release_rounds"] == [3, 4] and summary["creff_client_draws"] is None
    for c in range(run.data.clients):
        assert dp.ledgers[c].made == {CREFF_RELEASE: 2}
        assert summary["privacy"]["per_client_epsilon"][str(c)] == pytest.approx(
            opacus_eps(dp.sigmas[CREFF_RELEASE], 1.0, 2, dp.delta))
