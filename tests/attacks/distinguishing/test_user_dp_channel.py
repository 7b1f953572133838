"""The DP-FedAvg channel of ``audit dp`` (attacks/distinguishing/user_dp_channel.py): one round of the
real clipping and noise code with one client's whole data present or absent stays below the
accountant's charge for that round; noise cut to a quarter, or clipping off, is caught."""

from __future__ import annotations

import warnings

import pytest

from privfedcal.attacks.distinguishing.channels import Faults, build_channels, parse_channels
from privfedcal.attacks.distinguishing.games import play
from privfedcal.privacy.releases import USER_DP_RELEASE
from privfedcal.settings.run_config import RunConfig

BASE = dict(dataset="digits", clients=5, rounds=1, device="cpu", threads=1, transcript=False,
            seed=0, method="fedavg", dp_updates=True, dp_eps=1.0)


def channel(faults: Faults = Faults(), **kw):
    (ch,) = build_channels(RunConfig.of(**{**BASE, **kw}), faults=faults)
    return ch


@pytest.mark.parametrize("secure", [False, True], ids=["central", "distributed"])
def test_correct_release_stays_below_its_claim(secure):
    ch = channel(secagg_updates=secure)
    assert ch.name == USER_DP_RELEASE and ch.fields == ("train/local/*",)
    assert 0.99 < ch.claimed_eps <= 1.0 + 1e-9  # one round: the whole budget
    row = play(ch, 200_000)
    assert 0.1 < row["eps_lower"] < ch.claimed_eps, row


@pytest.mark.parametrize("faults", [Faults(noise_scale=0.25), Faults(clip=False)],
                         ids=["noise/4", "no-clip"])
def test_each_fault_is_caught(faults):
    row = play(channel(faults), 100_000)
    assert row["claimed_eps"] == pytest.approx(1.0, abs=0.01)  # the correct run's claim
    assert row["eps_lower"] > row["claimed_eps"], row


def test_claim_is_opacus_epsilon_of_one_round():
    from opacus.accountants import RDPAccountant

    from privfedcal.experiment import build_parts
    from privfedcal.privacy.user_dp import UserDP

    ch = channel(rounds=4, dp_eps=4.0)  # the plan: 4 rounds at q = 1; the channel: one
    uplink = build_parts(RunConfig.of(**{**BASE, "rounds": 4, "dp_eps": 4.0}))[2]
    sigma = uplink.find(UserDP).noise_multiplier
    acc = RDPAccountant()
    acc.step(noise_multiplier=sigma, sample_rate=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ch.claimed_eps == pytest.approx(acc.get_epsilon(ch.delta), rel=1e-9)
    assert parse_channels("dp-fedavg") == (USER_DP_RELEASE,)
