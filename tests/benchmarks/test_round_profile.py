"""benchmarks/engine/round_profile.py at tiny size: the parts of privfedcal's round are
timed, none is negative, and together they are the round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine" / "round_profile.py"


def test_the_parts_add_up_to_the_round(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "4", "--clients", "3",
                           "--repeats", "1", "--json", str(out)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    parts = results["parts"]
    assert results["rounds"] == 3  # rounds 2-4: the first has no start line
    assert parts["local training steps"] > 0 and parts["evaluation"] > 0
    assert parts["checkpoint"] > 0 and parts["transcript record"] > 0
    assert min(v for k, v in parts.items() if k != "other") >= 0
    assert abs(sum(parts.values()) - results["round_mean"]) < 1e-9
    assert results["writer"]["wall"] > 0  # the transcript thread wrote the round's files
