"""Every paper recipe in ``configs/`` resolves, and builds and runs one round on tiny data.

The files carry the papers' full budgets for real data; here each is read exactly as
``privfedcal train --config FILE`` reads it, then the same settings run for one round on a
generated npz of the dataset's image shape and class count (fewer images, one local epoch).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from privfedcal.cli.main import main
from privfedcal.experiment import check_calibration_params
from privfedcal.settings.run_config import RunConfig, load_toml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
# classes, image side, train images per class of the generated stand-in (ResNet-18 runs at
# 16 px: a 32 px epoch of it costs minutes on the 2-core CI machine)
SHAPES = {"cifar10": (10, 32, 30), "cifar100": (100, 16, 2), "stl10": (10, 96, 8)}
# server-side budgets cut for the tiny run (the resolve test checks the files' own values)
TINY_CALIBRATION = {"features_per_class": 10, "match_steps": 2, "retrain_steps": 2,
                    "virtual_per_class": 10}
SLOW = {"feduv-cifar100-a0.01", "feduv-cifar100-a1.0"}  # ResNet-18: tens of seconds each


def test_every_seed_row_has_a_file():
    names = {p.stem for p in CONFIGS}
    assert {"ccvr-cifar10-a0.5", "ccvr-cifar10-a0.1", "ccvr-cifar10-a0.05",
            "creff-cifar10lt-if100", "creff-cifar10lt-if50", "feduv-stl10-a0.01",
            "feduv-stl10-a1.0", "feduv-cifar100-a0.01", "feduv-cifar100-a1.0"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_resolves_with_the_papers_number(path):
    text = path.read_text()
    assert "Paper" in text and "privfedcal train --config" in text
    cfg = RunConfig.from_dict(load_toml(path))
    check_calibration_params(cfg)              # every [calibration_params] name is known
    assert cfg.training.rounds >= 60 and cfg.training.local_epochs == 10   # the papers' budgets, not reduced


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def _write_toml(path: Path, settings: dict) -> None:
    top = [f"{k} = {_toml_value(v)}" for k, v in settings.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "\n".join(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())
              for k, v in settings.items() if isinstance(v, dict)]
    path.write_text("\n".join(top) + "\n" + "\n".join(tables) + "\n")


def _tiny_npz(path: Path, dataset: str) -> None:
    classes, side, per_class = SHAPES[dataset]
    rng = np.random.default_rng(0)
    y_train = np.repeat(np.arange(classes), per_class)
    y_test = np.arange(classes)
    x_train = rng.integers(0, 256, size=(len(y_train), 3, side, side), dtype=np.uint8)
    x_test = rng.integers(0, 256, size=(len(y_test), 3, side, side), dtype=np.uint8)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in CONFIGS
], ids=[p.stem for p in CONFIGS])
def test_config_runs_one_round_on_tiny_data(path, tmp_path, capsys):
    settings = tomllib.loads(path.read_text())
    cal = settings.get("calibration_params", {})
    cal.update({k: v for k, v in TINY_CALIBRATION.items() if k in cal})
    data = tmp_path / "tiny.npz"
    _tiny_npz(data, settings["dataset"])
    settings.update(dataset=f"npz:{data}", rounds=1, local_epochs=1, min_size=1,
                    device="cpu", threads=1, transcript=False)
    tiny = tmp_path / "tiny.toml"
    _write_toml(tiny, settings)
    out = tmp_path / "run"
    main(["train", "--config", str(tiny), "--out", str(out)])
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    used = json.loads((out / "config.json").read_text())
    for key in ("method", "model", "clients", "partition", "alpha", "batch_size", "lr",
                "participation"):
        assert used[key] == settings[key], key
    assert 0.0 <= summary["accuracy"] <= 1.0
