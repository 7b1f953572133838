"""The one-run audit of a whole run's calibration uploads: the correct release stays below
its claim, a broken one (clipping off, noise scaled by 0.25) exceeds it, and a run without DP
is guessed right throughout."""

from __future__ import annotations

import pytest

from privfedcal.attacks.distinguishing.channels import Faults
from privfedcal.attacks.distinguishing.one_run import one_run
from privfedcal.errors import UsageError
from privfedcal.privacy.empirical import one_run_epsilon
from privfedcal.settings.run_config import RunConfig

BASE = dict(dataset="digits", clients=5, rounds=3, device="cpu", threads=1, transcript=False,
            seed=0)


@pytest.mark.parametrize("method", ["ccvr", "creff"])
def test_correct_below_and_clipping_off_above_the_claim(method):
    cfg = RunConfig.of(method=method, dp_eps=1.0, **BASE)
    good = one_run(cfg)
    bad = one_run(cfg, faults=Faults(clip=False))
    assert good["claimed_eps"] == bad["claimed_eps"] == pytest.approx(1.0, abs=0.01)
    assert good["eps_lower"] < good["claimed_eps"]
    assert bad["eps_lower"] > bad["claimed_eps"], bad
    # 5 clients x 10 classes x 128 feature axes, 5% of them guessed
    assert good["canary"].startswith("6400 canaries") and good["test_trials"] == 320


def test_ccvr_noise_divided_by_four_is_caught():
    row = one_run(RunConfig.of(method="ccvr", dp_eps=1.0, **BASE), faults=Faults(noise_scale=0.25))
    assert row["eps_lower"] > row["claimed_eps"], row


def test_without_dp_every_guess_is_right():
    row = one_run(RunConfig.of(method="ccvr", **BASE), axes=8, guesses=0.5)
    m = 5 * 10 * 8
    assert row["claimed_eps"] == float("inf") and row["false_pos"] == 0
    assert row["eps_lower"] == pytest.approx(one_run_epsilon(m, m // 2, m // 2, 0.0, 0.95))


def test_a_spent_budget_scores_the_clients_released_so_far():
    from privfedcal.attacks.distinguishing.games import BUDGET_STOP

    full = one_run(RunConfig.of(method="ccvr", dp_eps=1.0, **BASE), axes=4)
    row = one_run(RunConfig.of(method="ccvr", dp_eps=1.0, **BASE), axes=4, budget_s=1e-9)
    assert full["stopped"] == "" and full["canary"].startswith("200 canaries (5 clients")
    assert row["stopped"] == BUDGET_STOP and row["canary"].startswith("40 canaries (1 client x")
    assert row["claimed_eps"] == full["claimed_eps"]  # CCVR: one release per client


def test_bad_arguments():
    with pytest.raises(UsageError, match="guesses"):
        one_run(RunConfig.of(method="ccvr", **BASE), guesses=0.0)
    with pytest.raises(UsageError, match="calibration upload"):
        one_run(RunConfig.of(method="fedavg", **BASE))


def test_creff_releases_only_in_its_release_rounds():
    """``--creff-release-last 1``: each selected client releases once, in the last round, as
    the planner counts it; the audit's claim is the run's, not that of a release in every
    round the client is selected in."""
    cfg = RunConfig.of(method="creff", dp_eps=1.0, calibration_params={"creff_release_last": 1},
                    **BASE)
    row = one_run(cfg, axes=4)
    assert row["claimed_eps"] == pytest.approx(1.0, abs=0.01)
    assert row["eps_lower"] < row["claimed_eps"]
