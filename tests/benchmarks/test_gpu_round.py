"""benchmarks/engine/gpu_round.py at tiny size on the CPU: every finished run is a line on
disk as it ends, the budget stops new runs, and the full-budget row says why it did not run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine" / "gpu_round.py"


def run(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--images", "200",
                           "--rounds", "3", "--out", str(out), "--run-dir",
                           str(tmp_path / "runs"), "--pfl-python", "/nonexistent/python",
                           *flags], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.mark.slow
def test_pairs_are_measured_and_written_as_they_finish(tmp_path):
    rows = run(tmp_path, "--pairs", "1", "--budget-s", "600")
    kinds = [(r["kind"], r.get("way") or r.get("row")) for r in rows]
    assert kinds[0] == ("start", None)
    assert ("run", "privfedcal") in kinds and ("run", "bare") in kinds
    for r in rows:
        if r["kind"] == "run":
            assert len(r["round_seconds"]) == 2  # 3 rounds: the ends of rounds 1 to 3
            assert r["round"] > 0 and r["wall"] > r["round"]
    pairs = next(r for r in rows if r["kind"] == "pairs")
    assert pairs["ratios"]["bare"]["n"] == 1
    skipped = [r for r in rows if r["kind"] == "skipped"]
    assert any(r.get("way") == "pfl" for r in skipped)  # no such interpreter
    assert any("CIFAR-10" in r["why"] for r in skipped if r.get("row"))  # no data root


def test_the_budget_stops_new_runs(tmp_path):
    rows = run(tmp_path, "--pairs", "3", "--budget-s", "0")
    assert not [r for r in rows if r["kind"] == "run"]
    assert {"kind": "skipped", "way": "privfedcal", "pair": 0, "why": "out of time"} in rows
    assert rows[-1] == {"kind": "skipped", "row": "configs/ccvr-cifar10-a0.1.toml",
                        "why": "out of time"}


def test_an_interrupted_script_keeps_its_finished_runs(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--images", "200",
                             "--rounds", "3", "--pairs", "3", "--out", str(out)], env=env,
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while '"kind": "run"' not in (out.read_text() if out.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as a lease that ends mid-run
        proc.wait()
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["kind"] == "start"
    assert rows[-1]["kind"] == "run" and rows[-1]["way"] == "privfedcal"
