"""The adaptive clip (privacy/adaptive_clip.py) as its own update stage: registered before
DP-FedAvg, planned only with --dp-adaptive-clip, joined to DP-FedAvg as the policy that moves
its clip, refused without DP-FedAvg or under distributed noise, keeping no state of its own;
and the privacy of one adaptive round measured from what it releases: the sum's noise and
the count's noise together are one Gaussian of the charged multiplier z, a check that fails
for an adaptive clip that does not split the multiplier."""

from __future__ import annotations

import math

import pytest
import torch

from privfedcal.privacy import adaptive_clip
from privfedcal.privacy.adaptive_clip import AdaptiveClip
from privfedcal.privacy.executor import execute_plan
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.planner import plan_for_run, user_dp_of
from privfedcal.privacy.stage_registry import client_order, get_stage
from privfedcal.privacy.uplink import Uplink
from privfedcal.privacy.user_dp import UserDP, clip_update, model_delta, update_norm
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.settings.messages import SettingError
from tests.privacy.test_user_dp import one_round, stage


def _plan(tiny_cfg, **kw):
    from privfedcal.experiment import calibrator_class

    cfg = tiny_cfg(**kw)
    return plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000)


def test_the_stage_is_registered_before_dp_fedavg():
    entry = get_stage("adaptive-clip")
    assert entry.updates and not entry.wire and not entry.opt_in
    assert "dp-fedavg" in entry.before
    assert client_order(["secagg-updates", "dp-fedavg", "adaptive-clip"]) == [
        "adaptive-clip", "dp-fedavg", "secagg-updates"]


def test_a_run_plans_the_stage_only_with_the_adaptive_clip(tiny_cfg):
    adaptive = _plan(tiny_cfg, dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True,
                     dp_clip_quantile=0.7)
    assert [n for n, _ in adaptive.stages if get_stage(n).updates] == ["adaptive-clip",
                                                                       "dp-fedavg"]
    assert adaptive.setup_of("adaptive-clip") == 0.7
    fixed = _plan(tiny_cfg, dp_updates=True, dp_eps=8.0)
    assert fixed.setup_of("adaptive-clip") is None and fixed.setup_of("dp-fedavg") is not None
    up = execute_plan(adaptive)
    policy, udp = up.find(AdaptiveClip), up.find(UserDP)
    assert udp.adaptive is policy and policy.quantile == 0.7  # joined once the uplink is built
    assert udp.update_multiplier > udp.noise_multiplier  # the count takes its share
    assert "adaptive-clip" not in up.state_dict()["stages"]  # the clip is DP-FedAvg's state
    assert up.summary()["user_dp"]["adaptive_clip"]["quantile"] == 0.7
    assert execute_plan(fixed).find(UserDP).adaptive is None


def test_the_audit_builds_dp_fedavg_with_its_clip_policy(tiny_cfg):
    """``audit dp``'s DP-FedAvg (planner ``user_dp_of``) is the run's: the adaptive clip
    joined, so its noise on the sum is the run's ``z_u S``."""
    cfg = tiny_cfg(dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True)
    run = execute_plan(_plan(tiny_cfg, dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True))
    udp = user_dp_of(PrivacyOptions.of(cfg), run.accounting)
    assert isinstance(udp.adaptive, AdaptiveClip)
    assert udp.std == run.find(UserDP).std > udp.noise_multiplier * udp.clip


def test_the_stage_needs_dp_fedavg_with_central_noise():
    with pytest.raises(SettingError, match="plans no DP-FedAvg stage"):
        Uplink(update_stages=[AdaptiveClip(0.5)])
    distributed = UserDP(stage(), 1.0, denominator=4, distributed=True)
    with pytest.raises(SettingError, match="central noise only"):
        AdaptiveClip(0.5).join([distributed])
    with pytest.raises(SettingError, match="in \\(0, 1\\)"):
        get_stage("adaptive-clip").build(1.0, None)


def states_with_norms(norms, seed=0):
    """A float64 global state of 20,100 coordinates and one state per norm whose update
    has exactly that L2 norm."""
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.zeros(200, 100, dtype=torch.float64),
            "b": torch.zeros(200, dtype=torch.float64)}
    out = []
    for n in norms:
        d = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in glob.items()}
        out.append({k: v * (n / update_norm(d)) for k, v in d.items()})
    return glob, out


def measured_round_privacy(z=1.5, m=5, clip=0.2, quantile=0.5, seed=7):
    """``z_u^-2 + sigma_b^-2`` measured from one adaptive round's outputs (seeded noise, for
    this test only): ``z_u`` from the noise on the released sum (20,100 coordinates), and
    ``sigma_b`` from the count the new clip reveals, divided by the count's one draw."""
    glob, states = states_with_norms([0.5 * clip, 0.9 * clip, 2 * clip, 5 * clip, 9 * clip])
    udp = UserDP(stage(z=z), clip, denominator=m, distributed=False, seed=seed, seeded=True)
    AdaptiveClip(quantile).join([udp])
    new = one_round(udp, glob, states)[1]
    deltas = [model_delta(s, glob) for s in states]
    clipped = [clip_update(d, clip) for d in deltas]
    noise = torch.cat([(m * (new[k].double() - glob[k].double())
                        - sum(c[k] for c in clipped)).ravel() for k in ("w", "b")])
    z_u = float(noise.std()) / clip
    within = sum(update_norm(d) <= clip for d in deltas)
    noisy = m * (quantile - math.log(udp.clip / clip) / adaptive_clip.CLIP_LR)
    draw = float(torch.randn((1,), generator=noise_generator(seed, 1, -1, 303, seeded=True),
                             dtype=torch.float64))
    sigma_b = (noisy - within) / draw
    assert 0 < within < m  # the clip binds for some updates and not for others
    return z_u ** -2 + sigma_b ** -2


def test_the_sum_and_the_count_together_are_one_gaussian_of_the_charged_multiplier():
    assert measured_round_privacy(z=1.5) == pytest.approx(1.5 ** -2, rel=0.03)


def test_an_adaptive_clip_that_does_not_split_the_multiplier_fails_the_check(monkeypatch):
    """The check above can fail: with the sum noised at the whole ``z`` the count's release
    comes on top of the charge (a tenth of the round's privacy here)."""
    monkeypatch.setattr(adaptive_clip, "update_multiplier", lambda z, count_std: z)
    assert measured_round_privacy(z=1.5) > 1.05 * 1.5 ** -2
