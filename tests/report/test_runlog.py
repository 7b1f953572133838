"""RunLogger files of a real run: a CSV row every round (train loss on rounds that are not
evaluated), the sampled clients with their own losses, the partition; resume keeps them
consistent; TensorBoard events when asked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from privfedcal.errors import UsageError
from privfedcal.federation.runlog import parse_log, read_metrics_csv


def test_metrics_csv_has_every_round(run_dir):
    rows = read_metrics_csv(run_dir / "metrics.csv")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["train_loss"] is not None and r["train_loss"] > 0 for r in rows)
    assert rows[0]["accuracy"] is None  # round 1 is not evaluated (eval_every=2)
    evaluated = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in evaluated] == [2, 3]
    for e in evaluated:
        row = rows[e["round"] - 1]
        assert row["accuracy"] == pytest.approx(e["accuracy"])
        assert row["train_loss"] == pytest.approx(e["train_loss"])
        assert row["worst_class_accuracy"] == pytest.approx(
            min(v for v in e["per_class_accuracy"] if v is not None))
        assert row["clients"] == 2


def test_clients_log_matches_the_round(run_dir):
    from privfedcal.config import RunConfig
    from privfedcal.federation.simulator import Simulator

    lines = [json.loads(x) for x in (run_dir / "clients.jsonl").read_text().splitlines()]
    rows = read_metrics_csv(run_dir / "metrics.csv")
    part = json.loads((run_dir / "partition.json").read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg.pop("versions")
    sim = Simulator.__new__(Simulator)  # select_clients needs only the config
    sim.cfg = RunConfig.from_dict(cfg)
    for line, row in zip(lines, rows, strict=True):
        assert line["sampled"] == sim.select_clients(line["round"])
        assert [c["client"] for c in line["clients"]] == line["sampled"]
        for c in line["clients"]:
            assert c["samples"] == part["sizes"][c["client"]]
        # the round's train loss is the plain mean of the sampled clients' losses
        assert row["train_loss"] == pytest.approx(np.mean([c["train_loss"] for c in
                                                           line["clients"]]))
    counts = np.array(part["counts"])
    assert counts.shape == (4, 10) and counts.sum(axis=1).tolist() == part["sizes"]


def test_resume_rewrites_the_logs(tmp_path, tiny_cfg):
    from privfedcal.federation.simulator import Simulator

    cfg = tiny_cfg(rounds=3, eval_every=2)
    Simulator(cfg.replace(rounds=2), tmp_path).run()
    # pretend round 3 was half-written before a crash: resume must drop it
    with (tmp_path / "clients.jsonl").open("a") as f:
        f.write(json.dumps({"round": 3, "sampled": [], "clients": []}) + "\n")
    sim = Simulator(cfg, tmp_path)
    sim.restore()
    sim.run()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [json.loads(x)["round"] for x in
            (tmp_path / "clients.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_tensorboard_events(tmp_path, tiny_cfg):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from privfedcal.federation.simulator import Simulator

    sim = Simulator(tiny_cfg(rounds=2), tmp_path)
    sim.log.enable(parse_log("tensorboard"))
    sim.run()
    sim.log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert losses == pytest.approx([r["train_loss"] for r in rows], rel=1e-6)
    assert [e.step for e in acc.Scalars("test/accuracy")] == [1, 2]
    assert "clients/train_loss/000" in acc.Tags()["scalars"]


def test_parse_log():
    assert parse_log(None) == () and parse_log("") == ()
    with pytest.raises(UsageError, match="--log takes tensorboard"):
        parse_log("wandb")
