"""The one-run audit of a whole DP-SGD run (attacks/distinguishing/one_run_training.py): canaries join
their clients' data with a fair coin, the run's real training runs once, and the bound stays
below the run's claim; with DP-SGD broken (no noise, no clipping) it rises above it."""

from __future__ import annotations

import torch

from privfedcal.attacks.distinguishing.channels import Faults
from privfedcal.attacks.distinguishing.one_run_training import add_canaries, one_run_training
from privfedcal.settings.run_config import RunConfig

CFG = RunConfig.of(dataset="digits", clients=5, rounds=5, method="fedavg", dp_train=True,
                dp_eps=1.0, device="cpu", threads=1)


def test_canaries_join_only_their_clients_data_when_their_coin_says_so(tiny_cfg):
    from privfedcal.experiment import build_experiment

    exp = build_experiment(tiny_cfg(clients=3))
    before = [p.clone() for p in exp.parts]
    n = exp.data.x_train.shape[0]
    x, y, owner, member = add_canaries(exp, 4, torch.Generator().manual_seed(0))
    assert exp.data.x_train.shape[0] == n + 12 and torch.equal(exp.data.x_train[n:], x)
    for k in range(3):
        added = sorted(set(exp.parts[k].tolist()) - set(before[k].tolist()))
        want = [n + i for i in range(12) if owner[i] == k and member[i]]
        assert added == want and set(before[k].tolist()) <= set(exp.parts[k].tolist())


def test_a_correct_run_stays_below_its_claim_and_a_broken_one_does_not():
    ok = one_run_training(CFG, per_client=200)
    assert ok["claimed_eps"] <= 1.0 + 1e-6 and ok["eps_lower"] <= ok["claimed_eps"]
    broken = one_run_training(CFG, per_client=200, faults=Faults(noise_scale=0.0, clip=False))
    assert broken["eps_lower"] > broken["claimed_eps"], broken["canary"]


def test_a_spent_budget_stops_the_run_after_a_round():
    """With its budget spent the run stops after its first round: the canaries are scored on
    that round's global model, the claim is the accountant's charge for one round (below
    the run's), and the row says it was stopped."""
    from privfedcal.attacks.distinguishing.games import BUDGET_STOP

    cfg = CFG.replace(clients=3, rounds=3)
    seen = []
    row = one_run_training(cfg, per_client=20, budget_s=1e-9,
                           progress=lambda r, n: seen.append((r, n)))
    assert seen == [(1, 3)] and row["stopped"] == BUDGET_STOP
    assert "1 of the run's 3 rounds" in row["canary"]
    assert 0 < row["claimed_eps"] < 1.0 and row["delta"] > 0


def test_the_training_audit_needs_dp_sgd():
    import pytest

    from privfedcal.errors import UsageError

    with pytest.raises(UsageError, match="--dp-train"):
        one_run_training(CFG.replace(dp_train=False, method="ccvr"))
