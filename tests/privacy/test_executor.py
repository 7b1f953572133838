"""The executor: a frozen plan becomes a live uplink, afresh each time it is executed."""

from __future__ import annotations

import copy

import pytest
import torch

from privfedcal.errors import UsageError
from privfedcal.experiment import calibrator_class
from privfedcal.privacy.executor import execute_plan, training_spec
from privfedcal.privacy.planner import plan_for_run
from privfedcal.privacy.secagg_stage import EncryptStage
from privfedcal.privacy.stages import BoundStage, ClearWire, NoiseStage
from privfedcal.privacy.transcript import Transcript
from privfedcal.settings.floors import PrivacyOptions


def _plan(tiny_cfg, **kw):
    cfg = tiny_cfg(method="ccvr", **kw)
    return plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000)


def _uploads(n=4):
    return [(c, {"count": torch.tensor([2.0, 1.0], dtype=torch.float64),
                 "sum": torch.ones(2, 3, dtype=torch.float64),
                 "outer": torch.eye(3, dtype=torch.float64).expand(2, 3, 3).clone()})
            for c in range(n)]


def test_an_unprotected_plan_gives_the_plain_uplink(tiny_cfg):
    up = execute_plan(_plan(tiny_cfg))
    assert [type(s) for s in up.stages] == [BoundStage, ClearWire]
    assert up.summary() == {}


def test_stages_are_built_in_the_planned_order_around_one_noise_plan(tiny_cfg):
    plan = _plan(tiny_cfg, dp_eps=8.0, secagg=True)
    up = execute_plan(plan)
    assert [type(s) for s in up.stages] == [BoundStage, NoiseStage, EncryptStage]
    noise, wire = up.find(NoiseStage), up.find(EncryptStage)
    assert wire.secagg.dp is noise.dp  # the bounds leave room for the same noise
    assert noise.dp.sigmas == dict(plan.noise.sigmas)
    assert up.bound.bound == {"feature": 10.0, "class-gradient": 1.0}


def test_each_execution_starts_a_fresh_budget_and_leaves_the_plan_as_it_was(tiny_cfg):
    plan = _plan(tiny_cfg, dp_eps=8.0)
    before = copy.deepcopy(plan)
    first = execute_plan(plan)
    first.aggregate(_uploads(), round_=1, label="ccvr-stats", transcript=Transcript(None))
    first.find(NoiseStage).dp.sigmas["extra"] = 1.0  # the live copy may be extended (plugin)
    assert first.find(NoiseStage).dp.epsilon() > 0
    second = execute_plan(plan)
    assert second.find(NoiseStage).dp.epsilon() == 0
    assert plan == before and "extra" not in plan.noise.sigmas


def test_every_stage_with_state_is_saved_and_restored(tiny_cfg):
    plan = _plan(tiny_cfg, dp_eps=8.0, secagg=True, insecure_seeded_noise=True)
    up = execute_plan(plan)
    up.aggregate(_uploads(), round_=1, label="ccvr-stats", transcript=Transcript(None))
    state = up.state_dict()
    assert set(state["stages"]) == {"noise", "encrypt"}  # bound and wire-in-clear: none
    assert "ccvr-stats" in state["stages"]["encrypt"]["params_used"]
    fresh = execute_plan(plan)
    fresh.load_state_dict(state)
    assert fresh.find(NoiseStage).dp.epsilon() == pytest.approx(up.find(NoiseStage).dp.epsilon())
    assert fresh.summary()["secagg"]["params"] == up.summary()["secagg"]["params"]


def test_a_checkpoint_with_the_noise_state_alone_still_loads(tiny_cfg):
    plan = _plan(tiny_cfg, dp_eps=8.0)
    up = execute_plan(plan)
    up.aggregate(_uploads(), round_=1, label="ccvr-stats", transcript=Transcript(None))
    old = {"dp": up.find(NoiseStage).state_dict(), "user_dp": None, "rejected": [],
           "skipped": []}
    fresh = execute_plan(plan)
    fresh.load_state_dict(old)
    assert fresh.find(NoiseStage).dp.epsilon() == pytest.approx(up.find(NoiseStage).dp.epsilon())


def test_state_of_a_stage_the_run_does_not_plan_is_refused(tiny_cfg):
    up = execute_plan(_plan(tiny_cfg, dp_eps=8.0))
    state = up.state_dict()
    plain = execute_plan(_plan(tiny_cfg, secagg=True))
    with pytest.raises(UsageError, match="stage\\(s\\) noise"):
        plain.load_state_dict(state)


def test_training_spec_takes_the_planned_dp_sgd_schedule(tiny_cfg):
    from privfedcal.federation.local import LocalSpec
    from privfedcal.settings.sections import DataSettings, TrainingSettings

    spec = LocalSpec(TrainingSettings(local_epochs=1, batch_size=32, lr=0.1, momentum=0.0,
                                      weight_decay=0.0, seed=0), DataSettings(augment=False))
    assert training_spec(spec, _plan(tiny_cfg, dp_eps=8.0)) is spec
    plan = plan_for_run(PrivacyOptions.of(tiny_cfg(dp_eps=8.0, dp_train=True)), calibrator_class(tiny_cfg()),
                        1000)
    assert training_spec(spec, plan).dp_sgd == plan.dp_sgd is not None
