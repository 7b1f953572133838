"""privfedcal.flower.plugin.clip: the search of dp-clip = "auto" (its budget, grids, the
clip a node accepts, and the server's sum of the nodes' histograms)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.plugin.clip import AutoClip, histogram_total, stage_label  # noqa: E402
from privfedcal.privacy.accounting import ReleasePlan  # noqa: E402
from privfedcal.privacy.quantile import ClipSearch, plan_clip_noise  # noqa: E402
from privfedcal.settings.floors import PrivacyOptions

CCVR = [ReleasePlan("ccvr-stats", 1.0, 1)]


def test_the_two_stages_compose_to_the_planned_release():
    auto = AutoClip.plan(8.0, 1e-5, "rdp", CCVR)
    z1, z2 = auto.stage_sigma(1), auto.stage_sigma(2)
    # Gaussian RDP at order a is a / (2 z^2): the stages add up to one release of z
    assert 1 / z1**2 + 1 / z2**2 == pytest.approx(1 / auto.sigma**2)
    assert auto.search_epsilon == pytest.approx(0.8) and auto.delta == 1e-5
    assert (auto.sigma, [auto.calibration["ccvr-stats"]]) == plan_clip_noise(
        8.0, 1e-5, ClipSearch(), CCVR)


def test_the_search_is_planned_with_the_calibration_by_the_planner(tiny_cfg):
    """The protection plan of a CCVR run with the search's preset: the calibration's
    multiplier is the joint plan's, the two stages are planned releases at q = 1, and the
    live accountants charge the search and the calibration within epsilon."""
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.executor import execute_plan
    from privfedcal.privacy.planner import plan_for_run
    from privfedcal.privacy.stages import NoiseStage

    cfg = tiny_cfg(method="ccvr", dp_eps=8.0, dp_delta=1e-5)
    auto = AutoClip.plan(8.0, 1e-5, "rdp", CCVR)
    plan = plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000, auto.preset())
    assert dict(plan.noise.sigmas) == {
        "ccvr-stats": auto.calibration["ccvr-stats"],
        stage_label(1): auto.stage_sigma(1), stage_label(2): auto.stage_sigma(2)}
    assert plan.noise.rates[stage_label(1)] == 1.0
    dp = execute_plan(plan).find(NoiseStage).dp
    for stage in (1, 2):
        dp.record(stage_label(stage), [0])
    dp.check("ccvr-stats", [0])  # the calibration still fits after the search
    dp.record("ccvr-stats", [0])
    assert dp.epsilon() <= 8.0
    assert dp.ledger(0).limits == {"ccvr-stats": 1, stage_label(1): 1, stage_label(2): 1}
    other = tiny_cfg(method="ccvr", dp_eps=7.2, dp_delta=1e-5)
    with pytest.raises(UsageError, match="not the run's"):
        plan_for_run(PrivacyOptions.of(other), calibrator_class(other), 1000, auto.preset())


def test_grids_and_the_clip_a_node_accepts():
    auto = AutoClip.plan(8.0, 1e-5, "rdp", CCVR)
    assert torch.equal(auto.edges(1), ClipSearch().first_edges())
    assert torch.equal(auto.edges(2, 3.0), ClipSearch().fine_edges(3.0))
    for centre in (None, math.nan, -1.0):
        with pytest.raises(UsageError, match="centre"):
            auto.edges(2, centre)
    assert auto.check_clip(4) == 4.0
    for clip in (1e9, 0.0, True, "5", math.inf):
        with pytest.raises(UsageError, match="the clip must be a number"):
            auto.check_clip(clip)


def test_malformed_histograms_are_left_out_of_the_sum():
    good = {0: torch.tensor([1.0, 2.0, 3.0]), 2: torch.tensor([0.5, -1.0, 4.0])}
    bad = {1: torch.tensor([1.0, math.nan, 0.0]), 3: torch.tensor([1.0, 2.0]),
           4: torch.full((0,), math.nan)}
    total, dropped = histogram_total({**good, **bad}, 3)
    assert torch.equal(total, torch.tensor([1.5, 1.0, 7.0], dtype=torch.float64))
    assert dropped == [1, 3, 4]
