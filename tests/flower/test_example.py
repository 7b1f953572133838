"""The example Flower app runs `privfedcal train`'s default experiment."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from privfedcal.flower.records import parse_run_config  # noqa: E402
from privfedcal.settings.run_config import RunConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower" / "pyproject.toml"


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_example_defaults_are_train_defaults() -> None:
    project = tomllib.loads(EXAMPLE.read_text())
    cfg, _ = parse_run_config(_flatten(project["tool"]["flwr"]["app"]["config"]))
    default = RunConfig().flat()
    for name, got in cfg.flat().items():
        want = default[name]
        if name in ("method_params", "calibration_params"):
            got = {k: v for k, v in got.items() if v is not None}
        assert got == want, f"example {name} = {got!r}, privfedcal train's default {want!r}"


def test_example_simulation_has_one_supernode_per_client() -> None:
    project = tomllib.loads(EXAMPLE.read_text())
    sim = project["tool"]["flwr"]["federations"]["local-simulation"]
    assert sim["options"]["num-supernodes"] == RunConfig().data.clients


def test_example_declares_exactly_the_described_keys_and_defaults() -> None:
    """Every key of ``[tool.flwr.app.config]`` with the default of the settings' description
    (the Flower timeouts had drifted to 600/120 s here while the code said 3600/300 s)."""
    from privfedcal.settings.catalogue import flower_defaults

    project = tomllib.loads(EXAMPLE.read_text())
    declared = _flatten(project["tool"]["flwr"]["app"]["config"])
    want = flower_defaults()
    assert declared == want
    assert declared["flower.round-timeout"] == 3600.0 and declared["flower.node-wait"] == 300.0
