"""The attack on model updates: a recorded per-client update is inverted with the weight
read as n (never under --dp-train's uniform weights), and a transcript without one is
noted; on tiny digits runs with updates recorded as the transcript format prescribes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from privfedcal.attacks.reconstruction.runner import RunView, load_run
from privfedcal.attacks.reconstruction.updates_attack import UpdatesOptions, plan_updates
from privfedcal.calibration.ccvr import CCVR_RELEASE as STATS_LABEL
from privfedcal.cli.main import main
from privfedcal.errors import UsageError

FAST = ["--clients", "3", "--rounds", "1", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--dataset", "digits"]


@pytest.fixture(scope="module")
def ccvr_view(tmp_path_factory) -> RunView:
    run = tmp_path_factory.mktemp("updates") / "ccvr"
    main(["train", *FAST, "--method", "ccvr", "--out", str(run)])
    return load_run(run)


def updates_copy(view: RunView, dest: Path, *, weight: bool = True) -> tuple[Path, dict]:
    """The run with model updates recorded as the transcript format prescribes: a global
    state (label "round") and client 0's full state after local training, with its weight
    and recipe (here: one epoch of the run's recipe, simulated exactly)."""
    from privfedcal.attacks.reconstruction.model_updates import LocalRecipe, simulate_local_training

    shutil.copytree(view.run_dir, dest)
    tdir = dest / "server" / "transcript"
    entries = json.loads((tdir / "index.json").read_text())
    start = view.release(STATS_LABEL, None).state
    idx = view.truth_exp.parts[0]
    cfg = view.cfg
    recipe = LocalRecipe(1, cfg.training.batch_size, cfg.training.lr, cfg.training.momentum, cfg.training.weight_decay)
    after = {k: v.detach() for k, v in simulate_local_training(
        view.model, start, view.truth_exp.data.x_train[idx], view.truth_exp.data.y_train[idx],
        recipe).items()}
    after = {**start, **after}
    save_file(dict(start), str(tdir / "round.safetensors"))
    save_file(after, str(tdir / "update.safetensors"))
    entries.append({"round": 1, "label": "round", "view": "model-state", "client": None,
                    "file": "round.safetensors", "participants": [0, 1, 2]})
    entries.append({"round": 1, "label": "model-update", "view": "plain-upload", "client": 0,
                    "file": "update.safetensors",
                    "weight": float(idx.numel()) if weight else None, "bytes": 1,
                    "local_epochs": 1, "batch_size": cfg.training.batch_size, "lr": cfg.training.lr})
    (tdir / "index.json").write_text(json.dumps(entries))
    return dest, after


@pytest.mark.slow
def test_recorded_model_updates_are_attacked(ccvr_view, tmp_path):
    run, _ = updates_copy(ccvr_view, tmp_path / "up")
    view = load_run(run, exp=ccvr_view.truth_exp)
    plan = plan_updates(view, UpdatesOptions(steps=2, restarts=1))
    (job,) = plan.jobs
    n = int(ccvr_view.truth_exp.parts[0].numel())
    assert job.base["client"] == 0 and job.base["n"] == n and job.base["round"] == 1
    assert any("aggregation weight" in s for s in job.base["needed"])
    rec = job.run().record
    assert rec["target"] == "model-update" and rec["candidates"] == n
    assert rec["steps_run"] == 2 and isinstance(rec["label_count_error"], int)
    with pytest.raises(UsageError, match="sent no model update"):
        plan_updates(view, UpdatesOptions(), clients=[7])  # the run has clients 0-2
    # a transcript without recorded updates (older runs): noted, the simulated one is used
    bare = tmp_path / "bare"
    shutil.copytree(ccvr_view.run_dir, bare)
    index = bare / "server" / "transcript" / "index.json"
    index.write_text(json.dumps([e for e in json.loads(index.read_text())
                                 if e["label"] != "model-update"]))
    plain = plan_updates(load_run(bare, exp=ccvr_view.truth_exp), UpdatesOptions())
    assert not plain.jobs and "records no model updates" in plain.notes[0]


def test_uniform_dp_sgd_weight_is_not_taken_for_a_sample_count(ccvr_view, tmp_path):
    """Under --dp-train the server averages with weight 1 per client: the update attack must
    not invert a single image for a client of n (it would under-report), and the record says
    the update was DP-SGD's."""
    run, _ = updates_copy(ccvr_view, tmp_path / "dpsgd")
    index = run / "server" / "transcript" / "index.json"
    entries = json.loads(index.read_text())
    entries[-1]["weight"] = 1.0
    index.write_text(json.dumps(entries))
    config = json.loads((run / "server" / "config.json").read_text())
    n = int(ccvr_view.truth_exp.parts[0].numel())
    for dp_train, want_n in ((False, 1), (True, n)):
        config["dp_train"] = dp_train
        config["dp_eps"] = 8.0 if dp_train else None  # DP-SGD spends a budget
        (run / "server" / "config.json").write_text(json.dumps(config))
        (job,) = plan_updates(load_run(run, exp=ccvr_view.truth_exp), UpdatesOptions(steps=2)).jobs
        assert job.base["n"] == want_n and job.base["dp"] is dp_train
        assert any(("side knowledge" in s) is dp_train for s in job.base["needed"])
