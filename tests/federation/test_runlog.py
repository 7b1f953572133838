"""federation/runlog.py: metrics.csv, clients.jsonl and the --log parser, on known rows and
on a real run (a CSV row every round, train loss on rounds that are not evaluated, the
sampled clients with their own losses; resume keeps them consistent; TensorBoard events
when asked)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from privfedcal.errors import UsageError
from privfedcal.federation.runlog import (
    CSV_COLUMNS,
    RunLogger,
    csv_row,
    parse_log,
    read_metrics_csv,
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny real run: 4 clients, half of them per round, evaluated every second round."""
    from privfedcal.experiment import build_experiment
    from privfedcal.federation.simulator import Simulator
    from privfedcal.settings.run_config import RunConfig

    path = tmp_path_factory.mktemp("runlog") / "run"
    cfg = RunConfig.of(dataset="digits", clients=4, alpha=0.5, rounds=3, local_epochs=1,
                    batch_size=32, device="cpu", threads=1, seed=0, transcript=False,
                    participation=0.5, eval_every=2, out=str(path))
    Simulator(build_experiment(cfg), path).run()
    return path


def test_parse_log():
    assert parse_log(None) == () and parse_log("") == () and parse_log(" , ") == ()
    with pytest.raises(UsageError, match="--log takes tensorboard, got 'wandb'"):
        parse_log("wandb")


def test_csv_row_takes_the_worst_evaluated_class():
    rec = {"round": 3, "train_loss": 0.5, "accuracy": 0.7, "loss": 1.2,
           "per_class_accuracy": [0.9, None, 0.4, 0.8], "clients": 2, "seconds": 1.5}
    assert csv_row(rec) == {"round": 3, "train_loss": 0.5, "accuracy": 0.7, "loss": 1.2,
                            "worst_class_accuracy": 0.4, "clients": 2, "seconds": 1.5}
    assert csv_row({"round": 1})["worst_class_accuracy"] is None


def _exp(sizes):
    return SimpleNamespace(parts=[torch.arange(n) for n in sizes])


def test_round_writes_csv_and_clients_jsonl(tmp_path):
    log = RunLogger(tmp_path, _exp([10, 20, 30]))
    log.round({"round": 1, "train_loss": 2.0, "seconds": 0.5}, [2, 0], [1.5, 2.5])
    log.round({"round": 2, "train_loss": 1.0, "accuracy": 0.5, "loss": 1.4,
               "per_class_accuracy": [0.2, 0.8], "seconds": float("nan")}, [1], [0.75])
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines == [",".join(CSV_COLUMNS), "1,2.0,,,,2,0.5", "2,1.0,0.5,1.4,0.2,1,"]
    assert read_metrics_csv(tmp_path / "metrics.csv") == [
        {"round": 1.0, "train_loss": 2.0, "accuracy": None, "loss": None,
         "worst_class_accuracy": None, "clients": 2.0, "seconds": 0.5},
        {"round": 2.0, "train_loss": 1.0, "accuracy": 0.5, "loss": 1.4,
         "worst_class_accuracy": 0.2, "clients": 1.0, "seconds": None}]
    rows = [json.loads(x) for x in (tmp_path / "clients.jsonl").read_text().splitlines()]
    assert rows == [
        {"round": 1, "sampled": [2, 0], "clients": [
            {"client": 2, "samples": 30, "train_loss": 1.5},
            {"client": 0, "samples": 10, "train_loss": 2.5}]},
        {"round": 2, "sampled": [1], "clients": [
            {"client": 1, "samples": 20, "train_loss": 0.75}]}]
    log.close()


def test_restore_rewrites_logs_to_the_checkpoint(tmp_path):
    log = RunLogger(tmp_path)
    for r in (1, 2, 3):
        log.round({"round": r, "train_loss": float(r)}, [0], [0.1 * r])
    log.restore([{"round": 1, "train_loss": 1.0}, {"round": 2, "train_loss": 2.0}])
    assert [r["round"] for r in read_metrics_csv(tmp_path / "metrics.csv")] == [1.0, 2.0]
    rows = [json.loads(x) for x in (tmp_path / "clients.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["clients"] == [{"client": 0, "samples": None, "train_loss": 0.1}]


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
    from types import SimpleNamespace

    from privfedcal.federation.simulator import Simulator
    from privfedcal.settings.floors import PrivacyOptions
    from privfedcal.settings.run_config import RunConfig

    lines = [json.loads(x) for x in (run_dir / "clients.jsonl").read_text().splitlines()]
    rows = read_metrics_csv(run_dir / "metrics.csv")
    part = json.loads((run_dir / "private" / "partition.json").read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg.pop("versions")
    sim = Simulator.__new__(Simulator)  # select_clients needs only the privacy options
    sim.exp = SimpleNamespace(privacy=PrivacyOptions.of(RunConfig.from_dict(cfg)))
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
    from privfedcal.experiment import build_experiment
    from privfedcal.federation.simulator import Simulator

    cfg = tiny_cfg(rounds=3, eval_every=2)
    Simulator(build_experiment(cfg.replace(rounds=2)), tmp_path).run()
    # pretend round 3 was half-written before a crash: resume must drop it
    with (tmp_path / "clients.jsonl").open("a") as f:
        f.write(json.dumps({"round": 3, "sampled": [], "clients": []}) + "\n")
    sim = Simulator(build_experiment(cfg), tmp_path)
    sim.restore()
    sim.run()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [json.loads(x)["round"] for x in
            (tmp_path / "clients.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_tensorboard_events(tmp_path, tiny_cfg):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from privfedcal.experiment import build_experiment
    from privfedcal.federation.simulator import Simulator

    sim = Simulator(build_experiment(tiny_cfg(rounds=2)), tmp_path)
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
