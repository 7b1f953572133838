"""Accounting that matches who knows what: per client, q = 1 over the rounds it is selected
in (the server picks the clients from the public seed, so their sampling amplifies nothing)."""

from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from privfedcal.calibration.creff import CREFF_RELEASE
from privfedcal.errors import PrivacyBudgetError
from privfedcal.experiment import calibrator_class
from privfedcal.federation.setup import build_experiment
from privfedcal.privacy.accounting import PrivacyAccountant
from privfedcal.privacy.stages import NoiseStage
from privfedcal.protection import (
    DPStage,
    build_protected_uplink,
    participation_counts,
    release_plans,
)
from privfedcal.cohorts import select_clients


def opacus_eps(z, q, steps, delta):
    acc = RDPAccountant()
    acc.history = [(z, q, steps)]
    return acc.get_epsilon(delta=delta)


def stage(z=2.0, target=100.0):
    return DPStage(target=target, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                   sigmas={CREFF_RELEASE: z}, rates={CREFF_RELEASE: 1.0}, clip=1.0,
                   grad_clip=1.0, distributed=False, covers_updates=False)


def test_participation_counts_follow_the_public_selection(tiny_cfg):
    cfg = tiny_cfg(clients=10, participation=0.4, rounds=20)
    counts = participation_counts(cfg)
    manual = dict.fromkeys(range(10), 0)
    for r in range(1, 21):
        for c in select_clients(cfg, r):
            manual[c] += 1
    assert counts == manual and sum(counts.values()) == 20 * 4


def test_creff_plan_has_no_amplification_from_server_sampling(tiny_cfg):
    cfg = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=20)
    (plan,) = release_plans(cfg, calibrator_class(cfg))
    assert plan.sample_rate == 1.0
    assert plan.steps == max(participation_counts(cfg).values())


def test_planned_noise_meets_the_budget_without_amplification(tiny_cfg):
    cfg = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=20, dp_eps=8.0)
    up = build_protected_uplink(cfg, build_experiment(cfg), calibrator_class(cfg))
    dp = up.find(NoiseStage).dp
    z, delta = dp.sigmas[CREFF_RELEASE], dp.delta
    t_max = max(participation_counts(cfg).values())
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
