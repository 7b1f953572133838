"""federation/runlog.py: metrics.csv, clients.jsonl and the --log parser."""

from __future__ import annotations

import json
from types import SimpleNamespace

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
