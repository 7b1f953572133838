"""The toy update stage (toy_update.py): a protection of the model updates registered from
its own file, planned by the planner like the upload stages, run on every client's update
and on the round's average in a real training run, its state saved for resume. The
registration is undone after these tests (the rest of the suite sees the package's own
stages only)."""

from __future__ import annotations

import json

import pytest
import torch

from privfedcal.privacy import stage_registry
from privfedcal.privacy.executor import execute_plan
from privfedcal.privacy.planner import plan_for_run
from privfedcal.privacy.stage_registry import client_order
from privfedcal.settings.floors import PrivacyOptions
from tests.extensions import toy_update
from tests.extensions.toy_update import NAME, ToyUpdateStage

BASE = dict(dataset="digits", clients=4, alpha=0.5, local_epochs=1, batch_size=32, threads=1,
            seed=0, data_seed=0, progress=False)


@pytest.fixture(autouse=True, scope="module")
def registered():
    """The toy's entry while these tests run (importing the module registered it)."""
    stage_registry.register_stage(toy_update.ENTRY)
    yield
    stage_registry.STAGES.unregister(NAME)


def _plan(tiny_cfg, **kw):
    from privfedcal.experiment import calibrator_class

    cfg = tiny_cfg(**{"stages": NAME, **kw})
    return plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000)


def test_registered_from_its_file_as_an_update_stage():
    entry = stage_registry.get_stage(NAME)
    assert entry is toy_update.ENTRY and entry.updates and entry.opt_in
    assert client_order([NAME, "secagg-updates", "dp-fedavg"])[-1] == "secagg-updates"


def test_planned_where_named_and_built_among_the_update_stages(tiny_cfg):
    assert NAME not in dict(_plan(tiny_cfg, stages="").stages)
    plan = _plan(tiny_cfg, secagg_updates=True)
    assert [n for n, _ in plan.stages] == ["bound", NAME, "clear", "secagg-updates"]
    assert plan.setup_of(NAME).rounds == 2  # its set-up comes from the plan
    up = execute_plan(plan)
    assert [s.name for s in up.update_stages] == [NAME, "secagg-updates"]
    assert [type(s).__name__ for s in up.stages] == ["BoundStage", "ClearWire"]


def test_a_run_trains_the_same_model_while_the_server_sees_scaled_updates(tmp_path):
    """Through the API: the toy scales each update by 1/4 and the average back, exactly, so
    the run's model and accuracy are the plain run's bit for bit; the server's record holds
    the scaled states."""
    import privfedcal
    from privfedcal.federation.checkpoint import load_checkpoint
    from privfedcal.privacy.releases import UPDATE_RELEASE
    from privfedcal.privacy.transcript import load_transcript

    plain = privfedcal.train(rounds=2, out=tmp_path / "plain", **BASE)
    toy = privfedcal.train(rounds=2, out=tmp_path / "toy", **BASE, **toy_update.SETTINGS)
    assert toy_update.evidence(toy.path)["ran"]
    assert toy.summary["privacy"]["toy_update"]["scaled"] == 8  # 4 clients, 2 rounds
    assert json.loads((toy.path / "summary.json").read_text())["accuracy"] == \
        json.loads((plain.path / "summary.json").read_text())["accuracy"]
    a, b = (load_checkpoint(r.path / "final")["model"] for r in (plain, toy))
    assert all(torch.equal(a[k], b[k]) for k in a)

    def first_update(run):
        return next(e for e in load_transcript(run.server_view / "transcript")
                    if e["label"] == UPDATE_RELEASE)["tensors"]
    seen, clear = first_update(toy), first_update(plain)
    key = next(k for k, v in clear.items() if v.is_floating_point())
    assert torch.equal(seen[key], clear[key] * toy_update.FACTOR)


def test_its_state_is_saved_and_restored_on_resume(tmp_path):
    import privfedcal

    run = privfedcal.train(rounds=2, out=tmp_path / "run", transcript=False, **BASE,
                           **toy_update.SETTINGS)
    assert not toy_update.evidence(run.path)["resumed"]
    privfedcal.resume(run, rounds=3)
    seen = toy_update.evidence(run.path)
    assert seen["ran"] and seen["resumed"] and seen["summary"]["rounds"] == 3, seen


def test_its_state_travels_under_the_stages_key(tiny_cfg):
    up = execute_plan(_plan(tiny_cfg))
    stage = up.find(ToyUpdateStage)
    stage.scaled, stage.rounds = 5, 1
    state = up.state_dict()
    assert state["stages"][NAME] == {"scaled": 5, "rounds": 1, "restored": 0}
    fresh = execute_plan(_plan(tiny_cfg))
    fresh.load_state_dict(state)
    assert fresh.find(ToyUpdateStage).state_dict() == {"scaled": 5, "rounds": 1, "restored": 1}


def test_refused_beside_a_stage_that_takes_the_round(tiny_cfg):
    """DP-FedAvg receives the round itself (clip, sum, noise): the toy's halves would not
    run, so the uplink is refused rather than run without them."""
    from privfedcal.errors import UsageError

    with pytest.raises(UsageError, match="'dp-fedavg' receives the round itself: the halves "
                                         f"of {NAME} would not run"):
        execute_plan(_plan(tiny_cfg, dp_updates=True, dp_eps=8.0))
