"""The model updates' protections are stages of the stage registry (privacy/update_stage.py):
planned by ``plan_stages`` beside the upload stages, built by the executor into the uplink's
``update_stages``, their state saved by name with the others, and a checkpoint that keeps
a stage's state at its own top-level key still restored."""

from __future__ import annotations

from privfedcal.privacy.executor import execute_plan
from privfedcal.privacy.planner import plan_for_run
from privfedcal.privacy.secagg_updates import SecureUpdates
from privfedcal.privacy.stage_registry import get_stage
from privfedcal.privacy.user_dp import UserDP
from privfedcal.settings.floors import PrivacyOptions


def _uplink(tiny_cfg, **kw):
    from privfedcal.experiment import calibrator_class

    cfg = tiny_cfg(**kw)
    return execute_plan(plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000))


def test_the_built_in_update_stages_are_registered_and_planned(tiny_cfg):
    assert get_stage("dp-fedavg").updates and get_stage("secagg-updates").updates
    assert get_stage("secagg-updates").wire
    up = _uplink(tiny_cfg, dp_updates=True, dp_eps=8.0, secagg_updates=True)
    assert [type(s) for s in up.update_stages] == [UserDP, SecureUpdates]
    assert up.hides_updates and up.hides_loss and up.update_wire is up.find(SecureUpdates)
    assert up.accounting is up.find(UserDP).dp
    plain = _uplink(tiny_cfg)
    assert plain.update_stages == [] and not plain.hides_updates and plain.accounting is None


def test_an_update_stage_state_is_saved_by_name_and_read_from_its_own_key(tiny_cfg):
    up = _uplink(tiny_cfg, dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True)
    up.find(UserDP).clip = 0.75
    state = up.state_dict()
    assert state["stages"]["dp-fedavg"] == {"clip": 0.75}
    fresh = _uplink(tiny_cfg, dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True)
    fresh.load_state_dict(state)
    assert fresh.find(UserDP).clip == 0.75
    kept_apart = {k: v for k, v in state.items() if k != "stages"}
    kept_apart["stages"] = {k: v for k, v in state["stages"].items() if k != "dp-fedavg"}
    kept_apart["user_dp"] = {"clip": 0.5}  # a checkpoint with the clip at its own key
    fresh.load_state_dict(kept_apart)
    assert fresh.find(UserDP).clip == 0.5
