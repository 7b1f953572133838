"""The channels of a run configuration audited through the real release code: with the
correct mechanism the lower bound stays below the claimed epsilon; with a fault injected
(noise scaled by 0.25, clipping off, a key in the clear) it exceeds it. The channel list
covers every charged field of the threat-model table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from privfedcal.attacks.distinguishing.channels import (
    CHANNEL_FIELDS,
    Faults,
    build_channels,
    claimed,
    parse_channels,
)
from privfedcal.attacks.distinguishing.games import BUDGET_MIN_TRIALS, BUDGET_STOP, play
from privfedcal.attacks.fields_table import client_fields, declared
from privfedcal.calibration.ccvr import CCVR_RELEASE
from privfedcal.calibration.creff import CREFF_RELEASE
from privfedcal.errors import UsageError
from privfedcal.privacy.client_fields import CHARGED
from privfedcal.settings.run_config import RunConfig

BASE = dict(dataset="digits", clients=5, rounds=2, device="cpu", threads=1, transcript=False,
            seed=0)
FAULTS = [Faults(noise_scale=0.25), Faults(clip=False)]


def channel(method: str, eps: float, faults: Faults = Faults()):
    (ch,) = build_channels(RunConfig.of(method=method, dp_eps=eps, **BASE), faults=faults)
    return ch


@pytest.mark.parametrize("method", ["ccvr", "creff"])
def test_correct_release_stays_below_its_claim(method):
    ch = channel(method, 1.0)
    row = play(ch, 200_000)
    assert 0.99 < ch.claimed_eps <= 1.0 + 1e-9       # the whole budget: one channel
    assert 0.1 < row["eps_lower"] < ch.claimed_eps, row


@pytest.mark.parametrize("method", ["ccvr", "creff"])
@pytest.mark.parametrize("faults", FAULTS + [None], ids=["noise/4", "no-clip", "clear"])
def test_each_fault_is_caught(method, faults):
    clear = {"ccvr": "count", "creff": "count"}[method]  # CReFF under DP: sample weighting
    ch = channel(method, 1.0, faults or Faults(clear_key=clear))
    row = play(ch, 100_000)
    assert row["claimed_eps"] == pytest.approx(1.0, abs=0.01)  # the correct run's claim
    assert row["eps_lower"] > row["claimed_eps"], row


def test_claim_is_opacus_epsilon_of_the_channel_alone():
    from opacus.accountants import RDPAccountant

    # the run's noise stage, as far as a claim reads it
    plan = SimpleNamespace(dp=SimpleNamespace(sigmas={CREFF_RELEASE: 1.3}, delta=1e-5,
                                              accountant=SimpleNamespace(kind="rdp")))
    acc = RDPAccountant()
    acc.history = [(1.3, 1.0, 3)]                       # three releases at q = 1
    assert claimed(plan, CREFF_RELEASE, 3) == (pytest.approx(acc.get_epsilon(1e-5)), 1e-5)
    assert claimed(None, CREFF_RELEASE, 3) == (float("inf"), 0.0)
    assert "in each of 2 rounds" in channel("creff", 2.0).canary   # rounds = 2, all chosen
    # --creff-release-last 1: the channel claims the one release the plan charges (counted
    # over every round, its noise planned for one release would claim past the budget)
    (last,) = build_channels(RunConfig.of(method="creff", dp_eps=2.0, **{
        **BASE, "calibration_params": {"creff_release_last": 1}}))
    assert "in each of 1 rounds" in last.canary
    assert 1.9 < last.claimed_eps <= 2.0 + 1e-9


def test_no_dp_has_no_claim_and_a_large_bound():
    (ch,) = build_channels(RunConfig.of(method="ccvr", **BASE))
    row = play(ch, 2_000)
    assert ch.claimed_eps == float("inf") and row["false_pos"] + row["false_neg"] == 0
    assert row["eps_lower"] > 5


def test_channel_names_are_checked():
    assert parse_channels(None) is None
    assert parse_channels("ccvr-stats, dp-sgd") == (CCVR_RELEASE, "dp-sgd")
    with pytest.raises(UsageError, match="--channels"):
        parse_channels("ccvr")
    with pytest.raises(UsageError, match="releases no dp-sgd"):
        build_channels(RunConfig.of(method="ccvr", dp_eps=1.0, **BASE), ("dp-sgd",))
    with pytest.raises(UsageError, match="no channel to audit"):
        build_channels(RunConfig.of(method="fedavg", **BASE))


def test_channels_cover_every_charged_field():
    for fields in CHANNEL_FIELDS.values():
        for name in fields:
            assert declared(*name.split("/")) is not None, name
    covered = {f for fs in CHANNEL_FIELDS.values() for f in fs}
    for f in client_fields():
        if not f.budget.startswith(CHARGED):  # "public: ... not charged" is public
            continue
        # under --secagg the same releases reach the server as a ciphertext and its
        # decrypted sum: the payload channels audit that sum (with the full variance)
        secagg_form = f.record in ("ciphertext", "aggregate")
        assert f.name in covered or secagg_form, f.name
    assert CREFF_RELEASE in CHANNEL_FIELDS


@pytest.mark.slow
def test_dpsgd_update_is_audited_and_clipping_off_is_caught():
    cfg = RunConfig.of(dataset="digits", clients=18, method="fedavg", dp_eps=1.0, dp_train=True,
                    rounds=1, batch_size=32, device="cpu", threads=1, transcript=False, seed=0)
    (ok,) = build_channels(cfg)
    (broken,) = build_channels(cfg, faults=Faults(clip=False))
    assert ok.claimed_eps == broken.claimed_eps < 1.0 + 1e-9
    good, bad = play(ok, 100), play(broken, 100)
    assert good["eps_lower"] < ok.claimed_eps
    assert bad["eps_lower"] > broken.claimed_eps, bad
    assert "train-loss" not in good["score"]            # no loss reaches the server


def test_dpsgd_game_stops_at_its_budget_with_a_row():
    """A DP-SGD trial is a local training: a budget too small for one chunk stops the game
    after the fewest trials that give a bound (2 per side), and the row says so."""
    cfg = RunConfig.of(method="fedavg", dp_eps=4.0, dp_train=True, **BASE)
    (ch,) = build_channels(cfg)
    assert ch.chunk > BUDGET_MIN_TRIALS
    row = play(ch, 1_000, budget_s=1e-9)
    assert row["trials"] == 2 * BUDGET_MIN_TRIALS and row["stopped"] == BUDGET_STOP
    assert row["eps_lower"] == 0.0 and 0 < row["claimed_eps"] < 4.0 + 1e-9


def test_clipping_off_is_caught_whatever_the_clip_bound():
    # the canary is sized from the bound the sensitivities assume (4 x 100 here), not from
    # the broken release's missing one
    cfg = RunConfig.of(method="ccvr", dp_eps=1.0, dp_clip=100.0, **BASE)
    (ch,) = build_channels(cfg, faults=Faults(clip=False))
    row = play(ch, 20_000)
    assert row["eps_lower"] > row["claimed_eps"], row
