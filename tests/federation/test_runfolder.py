"""federation/runfolder.py: the run folder's layout (server/, private/, the experimenter's
top level), config.json and partition.json, written and read in one place."""

from __future__ import annotations

import json
import platform
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import privfedcal
from privfedcal.errors import UsageError
from privfedcal.federation.runfolder import (
    partition_file,
    server_view,
    versions,
    write_config,
    write_run_files,
)
from privfedcal.settings.run_config import RunConfig, read_run_config


def test_versions():
    assert versions() == {"privfedcal": privfedcal.__version__, "torch": torch.__version__,
                          "numpy": np.__version__, "python": platform.python_version()}


def test_config_round_trip_and_record_keys(tmp_path):
    cfg = RunConfig.of(dataset="digits", clients=3, alpha=0.3, seed=5, method="fedprox",
                    method_params={"mu": 0.1})
    path = write_config(tmp_path / "run", cfg.to_dict(), flower_run_id="42")
    raw = json.loads(path.read_text())
    assert raw["versions"] == versions() and raw["flower_run_id"] == "42"
    assert {k: raw[k] for k in ("dataset", "clients", "alpha", "seed", "method")} == {
        "dataset": "digits", "clients": 3, "alpha": 0.3, "seed": 5, "method": "fedprox"}
    assert read_run_config(tmp_path / "run") == cfg
    with pytest.raises(ValueError, match="not run-record keys: colour"):
        write_config(tmp_path / "x", cfg.to_dict(), colour="red")


def test_run_files_split_the_server_view_from_the_private_part(tmp_path):
    """The data seed and the partition stay out of ``server/``: its config.json is the
    run's without the data seed; the partition goes to ``private/``; a server's experiment
    (no partition, a Flower ServerApp's) writes no ``private/`` at all."""
    cfg = RunConfig.of(dataset="digits", data_seed=77)
    exp = SimpleNamespace(record=cfg.to_dict(), parts=[torch.arange(3), torch.arange(4)],
                          partition_record=lambda: {"sizes": [3, 4], "counts": [[1, 2], [4, 0]]})
    write_run_files(tmp_path, exp, flower_run_id="9")
    assert json.loads((tmp_path / "private" / "partition.json").read_text()) == {
        "sizes": [3, 4], "counts": [[1, 2], [4, 0]]}
    assert not (tmp_path / "partition.json").exists()
    assert read_run_config(tmp_path) == cfg  # the experimenter's: resume and re-runs
    public = json.loads((tmp_path / "server" / "config.json").read_text())
    assert public["data_seed"] is None and "77" not in json.dumps(public)
    assert read_run_config(tmp_path / "server") == cfg.replace(data_seed=None)
    assert server_view(tmp_path) == tmp_path / "server"
    assert partition_file(tmp_path) == tmp_path / "private" / "partition.json"
    server = tmp_path / "flower"
    write_run_files(server, SimpleNamespace(record=cfg.replace(data_seed=None).to_dict(), parts=None))
    assert sorted(p.name for p in server.iterdir()) == ["config.json", "server"]
    assert partition_file(server) is None


def test_runs_from_before_the_data_seed_read_back_with_the_seed(tmp_path):
    """A config.json without a data_seed key was partitioned with the seed: resume, the
    report and attacks redraw that partition; its transcript sat at the top."""
    raw = {k: v for k, v in RunConfig.of(seed=5).to_dict().items() if k != "data_seed"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_run_config(tmp_path).training.data_seed == 5
    assert server_view(tmp_path) == tmp_path


def test_unreadable_run_folders_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="is not a run folder"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="settings object"):
        read_run_config(tmp_path)
