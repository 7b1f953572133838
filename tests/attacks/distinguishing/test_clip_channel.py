"""The feature clip's channel of ``audit dp`` (attacks/distinguishing/clip_channel.py): the Flower
plugin's two noisy norm histograms, through the real ``noisy_norm_histogram``, with one
sample more or less stay below the accountant's charge for the search; noise cut to a
quarter, or the histogram's sensitivity taken as 1/2, is caught."""

from __future__ import annotations

import warnings

import pytest

from privfedcal.attacks.distinguishing.channels import Faults, build_channels, parse_channels
from privfedcal.attacks.distinguishing.games import play
from privfedcal.errors import UsageError
from privfedcal.privacy import quantile
from privfedcal.privacy.accounting import ReleasePlan
from privfedcal.privacy.quantile import QUANTILE_RELEASE, ClipSearch, plan_clip_noise
from privfedcal.settings.run_config import RunConfig

# epsilon 10: the search's share (0.1) claims about 1, where a broken release is caught
BASE = dict(dataset="digits", clients=5, rounds=1, device="cpu", threads=1, transcript=False,
            seed=0, method="ccvr", dp_eps=10.0)


def channel(faults: Faults = Faults(), **kw):
    (ch,) = build_channels(RunConfig.of(**{**BASE, **kw}), (QUANTILE_RELEASE,), faults=faults)
    return ch


def test_correct_release_stays_below_its_claim():
    ch = channel()
    assert ch.name == QUANTILE_RELEASE and ch.fields == ("query.clip/histogram/counts",)
    assert ch.claimed_eps == pytest.approx(1.0, rel=1e-2) and ch.claimed_eps <= 1.0 + 1e-9
    row = play(ch, 200_000)
    assert 0.1 < row["eps_lower"] < ch.claimed_eps, row


def test_noise_cut_is_caught():
    row = play(channel(Faults(noise_scale=0.25)), 100_000)
    assert row["claimed_eps"] == pytest.approx(1.0, rel=1e-2)  # the correct run's claim
    assert row["eps_lower"] > row["claimed_eps"], row


def test_halved_sensitivity_is_caught(monkeypatch):
    ch = channel()
    monkeypatch.setattr(quantile, "SENSITIVITY", 0.5)  # noise for half the true change
    row = play(ch, 400_000)  # about 1.2 against 1.0 at 200,000 (1.14 to 1.25 in 5 draws)
    assert row["eps_lower"] > ch.claimed_eps, row


def test_claim_is_opacus_epsilon_of_the_two_stages():
    from opacus.accountants import RDPAccountant

    ch = channel()
    delta = ch.delta
    z, _ = plan_clip_noise(10.0, delta, ClipSearch(), [ReleasePlan("ccvr-stats", 1.0, 1)])
    acc = RDPAccountant()
    for s in ClipSearch().stage_sigmas(z):
        acc.step(noise_multiplier=s, sample_rate=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ch.claimed_eps == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert parse_channels("feature-clip") == (QUANTILE_RELEASE,)
    # only when asked, and only for a configuration with a DP calibration release
    assert [c.name for c in build_channels(RunConfig.of(**BASE))] == ["ccvr-stats"]
    with pytest.raises(UsageError, match="releases no feature-clip"):
        build_channels(RunConfig.of(**{**BASE, "dp_eps": float("inf")}), (QUANTILE_RELEASE,))
