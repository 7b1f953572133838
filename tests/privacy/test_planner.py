"""The protection planner (privfedcal/privacy/planner.py): a pure function of its inputs."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from privfedcal.errors import UsageError
from privfedcal.experiment import calibrator_class
from privfedcal.privacy.plan import ProtectionInputs
from privfedcal.privacy.planner import plan_protection, protection_inputs
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.settings.floors import PrivacyOptions


def _inputs(tiny_cfg, **kw) -> ProtectionInputs:
    cfg = tiny_cfg(**{"method": "ccvr", **kw})
    return protection_inputs(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000)


def test_inputs_are_gathered_from_the_run_config_once(tiny_cfg):
    inputs = _inputs(tiny_cfg, dp_eps=8.0, secagg=True, participation=0.5, clients=8,
                     stages=" a, b ")
    p = inputs.privacy
    assert (p.dp_eps, p.secagg, p.clients, p.participation) == (8.0, True, 8, 0.5)
    assert [s.spec.label for s in inputs.releases] == ["ccvr-stats"]
    assert inputs.examples == 1000 and inputs.stages == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.examples = 1  # type: ignore[misc]


@pytest.mark.parametrize("flags", [{}, {"dp_eps": 8.0}, {"secagg": True, "hide_counts": True},
                                   {"dp_eps": 8.0, "secagg": True, "secagg_updates": True},
                                   {"method": "fedavg", "dp_eps": 4.0, "dp_train": True},
                                   {"method": "fedavg", "dp_eps": 4.0, "dp_updates": True}])
def test_the_same_options_give_the_same_plan_and_stay_as_they_were(tiny_cfg, flags):
    inputs = _inputs(tiny_cfg, **flags)
    kept = copy.deepcopy(inputs)
    first, second = plan_protection(inputs), plan_protection(inputs)
    assert first == second and inputs == kept
    assert first.protected == bool(flags)


def test_the_plan_holds_what_the_run_executes(tiny_cfg):
    plan = plan_protection(_inputs(tiny_cfg, method="fedavg", calibrate="ccvr", dp_eps=4.0,
                                    dp_train=True, secagg=True))
    assert [name for name, _ in plan.stages] == ["bound", "noise", "encrypt"]
    assert set(plan.noise.sigmas) == {"ccvr-stats", DPSGD_RELEASE}
    assert plan.dp_sgd.noise_multiplier == plan.noise.sigmas[DPSGD_RELEASE]
    assert plan.ckks.min_clients == 2 and "outer" in plan.ckks.symmetric["ccvr-stats"]


def test_whole_run_checks_refuse_before_any_work(tiny_cfg):
    with pytest.raises(UsageError, match="nothing to protect"):
        plan_protection(_inputs(tiny_cfg, method="fedavg", dp_eps=8.0))
    with pytest.raises(UsageError, match="fewer than --secagg-min-clients 3"):
        plan_protection(_inputs(tiny_cfg, secagg=True, secagg_min_clients=3, clients=2))
    inputs = dataclasses.replace(_inputs(tiny_cfg, dp_eps=8.0), examples=None)
    with pytest.raises(UsageError, match="number of training examples"):
        plan_protection(inputs)


def test_the_privacy_options_alone_give_the_calibrators_inputs(tiny_cfg):
    """The experiment plans from ``exp.privacy``: the calibrator's release schedule and
    advice read the options' rounds and calibration parameters."""
    cfg = tiny_cfg(method="creff", rounds=6, dp_eps=8.0,
                   calibration_params={"creff_release_last": 2, "creff_weighting": "client"})
    calibrator = calibrator_class(cfg)
    narrow = protection_inputs(PrivacyOptions.of(cfg), calibrator, 1000)
    assert [s.rounds for s in narrow.releases if s.spec.participants != "all"] == [(5, 6)]
    assert len(narrow.hints) == 1 and "--creff-weighting sample" in narrow.hints[0]
