"""The plugin's feature clip without a number from the user: under DP the nodes' private
search chooses it (plugin/clip.py ``default_clip``), within the run's one budget; a number
given is used as is; the copyable example config carries no clip tuned to privfedcal's CNN."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.plugin.plugin_settings import gather, resolve  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_under_dp_the_clip_comes_from_the_search():
    s = resolve(gather({"dp_eps": 8.0}, {}), clients=3)
    assert s.auto_clip is not None and s.cfg.privacy.dp_clip is None
    assert s.flat["dp-clip"] == "auto"  # both sides' digest says so
    # the search's cost: a tenth of the budget, the calibration release the rest (RDP)
    assert s.auto_clip.search_epsilon == pytest.approx(0.8)


def test_a_clip_given_is_used():
    s = resolve(gather({"dp_eps": 8.0, "dp_clip": 2.5}, {}), clients=3)
    assert s.auto_clip is None and s.cfg.privacy.dp_clip == 2.5
    run = resolve(gather({}, {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 2.5}), clients=3)
    assert run.auto_clip is None and run.cfg.privacy.dp_clip == 2.5


def test_without_dp_no_search():
    s = resolve(gather({"secagg": True}, {}), clients=3)
    assert s.auto_clip is None and not math.isfinite(s.cfg.privacy.dp_eps)


def test_a_budget_too_small_for_the_search_says_to_give_a_clip():
    with pytest.raises(UsageError, match="set privfedcal.dp-clip to a number"):
        resolve(gather({"dp_eps": 1.0, "examples": 50_000}, {}), clients=3)


def test_the_example_config_carries_no_clip():
    config = tomllib.loads((EXAMPLES / "quickstart_calibrated" / "pyproject.toml")
                           .read_text())["tool"]["flwr"]["app"]["config"]
    assert "dp-eps" in config["privfedcal"] and "dp-clip" not in config["privfedcal"]
