"""federation/runfolder.py: config.json and partition.json, written and read in one place."""

from __future__ import annotations

import json
import platform
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import privfedcal
from privfedcal.config import RunConfig
from privfedcal.errors import UsageError
from privfedcal.federation.runfolder import (
    read_run_config,
    versions,
    write_config,
    write_run_files,
)


def test_versions():
    assert versions() == {"privfedcal": privfedcal.__version__, "torch": torch.__version__,
                          "numpy": np.__version__, "python": platform.python_version()}


def test_config_round_trip_and_record_keys(tmp_path):
    cfg = RunConfig(dataset="digits", clients=3, alpha=0.3, seed=5, method="fedprox",
                    method_params={"mu": 0.1})
    path = write_config(tmp_path / "run", cfg, flower_run_id="42")
    raw = json.loads(path.read_text())
    assert raw["versions"] == versions() and raw["flower_run_id"] == "42"
    assert {k: raw[k] for k in ("dataset", "clients", "alpha", "seed", "method")} == {
        "dataset": "digits", "clients": 3, "alpha": 0.3, "seed": 5, "method": "fedprox"}
    assert read_run_config(tmp_path / "run") == cfg
    with pytest.raises(ValueError, match="not run-record keys: colour"):
        write_config(tmp_path / "x", cfg, colour="red")


def test_run_files_write_the_partition(tmp_path):
    exp = SimpleNamespace(cfg=RunConfig(dataset="digits"),
                          partition_record=lambda: {"sizes": [3, 4], "counts": [[1, 2], [4, 0]]})
    write_run_files(tmp_path, exp)
    assert json.loads((tmp_path / "partition.json").read_text()) == {
        "sizes": [3, 4], "counts": [[1, 2], [4, 0]]}
    assert read_run_config(tmp_path) == RunConfig(dataset="digits")


def test_unreadable_run_folders_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="is not a run folder"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="settings object"):
        read_run_config(tmp_path)
