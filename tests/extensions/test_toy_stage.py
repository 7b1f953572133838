"""The toy stage (toy_stage.py): registered from its own file, placed after the noise,
set up from the plan, undone on the server, its state saved for resume. The registration
is undone after these tests (the rest of the suite sees the package's own stages only)."""

from __future__ import annotations

import pytest
import torch

from privfedcal.errors import UsageError
from privfedcal.privacy import stage_registry
from privfedcal.privacy.executor import execute_plan
from privfedcal.privacy.planner import plan_for_run
from privfedcal.privacy.stage_registry import client_order
from privfedcal.privacy.transcript import Transcript
from privfedcal.settings.floors import PrivacyOptions
from tests.extensions import toy_stage
from tests.extensions.toy_stage import NAME, ToyScaleStage


@pytest.fixture(autouse=True, scope="module")
def registered():
    """The toy's entry while these tests run (importing the module registered it)."""
    stage_registry.register_stage(toy_stage.ENTRY)
    yield
    stage_registry.STAGES.unregister(NAME)


def _plan(tiny_cfg, **kw):
    from privfedcal.experiment import calibrator_class

    cfg = tiny_cfg(**{"method": "ccvr", "stages": NAME, **kw})
    return plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg), 1000)


def _uploads():
    """Two CCVR-shaped uploads with whole numbers (scaling by 1/2 and back is exact)."""
    g = torch.Generator().manual_seed(0)
    return [(c, {"count": torch.tensor([3.0, 1.0], dtype=torch.float64),
                 "sum": torch.randint(-9, 9, (2, 3), generator=g).double(),
                 "outer": torch.eye(3, dtype=torch.float64).expand(2, 3, 3).clone() * (c + 1)})
            for c in (0, 1)]


def test_registered_from_its_file_opt_in_after_the_noise():
    assert stage_registry.get_stage(NAME) is toy_stage.ENTRY and toy_stage.ENTRY.opt_in
    assert client_order([NAME, "encrypt", "noise", "bound"]) == ["bound", "noise", NAME,
                                                                 "encrypt"]


def test_planned_only_where_the_run_names_it(tiny_cfg):
    assert NAME not in dict(_plan(tiny_cfg, stages="").stages)
    plan = _plan(tiny_cfg, dp_eps=8.0)
    assert [n for n, _ in plan.stages] == ["bound", "noise", NAME, "clear"]
    # its set-up comes from the plan: the releases the calibrator declares
    assert plan.setup_of(NAME).labels == {"ccvr-stats"}
    with pytest.raises(UsageError, match=f"stages a run can name: .*{NAME}"):
        _plan(tiny_cfg, stages="no-such-stage")


def test_clients_send_scaled_uploads_and_the_server_gets_the_plain_sum(tiny_cfg, tmp_path):
    from privfedcal.privacy.transcript import load_transcript

    up = execute_plan(_plan(tiny_cfg))  # the toy alone: no bound, in the clear
    assert [type(s).__name__ for s in up.stages] == ["BoundStage", "ToyScaleStage",
                                                     "ClearWire"]
    uploads = _uploads()
    tr = Transcript(tmp_path / "t")
    total = up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=tr)
    tr.flush()
    for k in total:  # sum of the uploads, computed here without the uplink
        assert torch.equal(total[k], uploads[0][1][k] + uploads[1][1][k])
    seen = {e["client"]: e["tensors"] for e in load_transcript(tr.directory)}
    assert torch.equal(seen[1]["sum"], uploads[1][1]["sum"] * 0.5)  # what crossed the wire
    other = up.aggregate(uploads, round_=1, label="not-declared", transcript=Transcript(None))
    assert torch.equal(other["count"], torch.tensor([6.0, 2.0], dtype=torch.float64))


def test_its_count_is_saved_and_restored(tiny_cfg):
    plan = _plan(tiny_cfg)
    up = execute_plan(plan)
    for r in (1, 2):
        up.aggregate(_uploads(), round_=r, label="ccvr-stats", transcript=Transcript(None))
    state = up.state_dict()
    assert state["stages"][NAME] == {"scaled": {"ccvr-stats": 2}, "rounds": 0, "restored": 0}
    fresh = execute_plan(plan)  # the same plan, executed again: a fresh count
    assert fresh.find(ToyScaleStage).scaled == {}
    fresh.load_state_dict(state)
    assert fresh.find(ToyScaleStage).scaled == {"ccvr-stats": 2}
    assert fresh.summary()["toy_scale"] == {"factor": 0.5, "scaled": {"ccvr-stats": 2},
                                            "rounds": 0, "restored": 1}


def test_under_dp_and_ckks_the_sum_is_unscaled(tiny_cfg):
    """With DP noise and CKKS: the decrypted sum, divided back, is within the noise of the
    plain sum (seeded noise, sigma planned for epsilon 50: small against the counts)."""
    plan = _plan(tiny_cfg, dp_eps=50.0, secagg=True, insecure_seeded_noise=True,
                 secagg_min_clients=2)
    assert [n for n, _ in plan.stages] == ["bound", "noise", NAME, "encrypt"]
    up = execute_plan(plan)
    uploads = [(c, p) for c, p in _uploads()] + [(2, _uploads()[0][1]), (3, _uploads()[1][1])]
    total = up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=Transcript(None))
    want = sum(p["count"] for _, p in uploads)
    assert torch.allclose(total["count"], want, atol=2.0)  # not want / 2: undone


def test_a_run_with_the_stage_resumes_with_its_state(tmp_path):
    """Through the API, as a user runs it: two rounds, then extended to three; the stage
    counted every round, the first two from the checkpoint (``evidence``)."""
    import privfedcal

    base = dict(dataset="digits", clients=4, alpha=0.5, local_epochs=1, batch_size=32,
                threads=1, seed=0, data_seed=0, progress=False, method="ccvr")
    run = privfedcal.train(rounds=2, out=tmp_path / "run", **base, **toy_stage.SETTINGS)
    assert toy_stage.evidence(run.path)["ran"]
    assert not toy_stage.evidence(run.path)["resumed"]
    privfedcal.resume(run, rounds=3)
    seen = toy_stage.evidence(run.path)
    assert seen["ran"] and seen["resumed"] and seen["summary"]["rounds"] == 3, seen
