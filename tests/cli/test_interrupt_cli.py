"""Ctrl-C: any command stops with one line on stderr and exit code 130, never a traceback;
an interrupted training run keeps a checkpoint that ``train --resume`` continues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli

from privfedcal.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--clients", "4", "--local-epochs", "1", "--device", "cpu", "--threads", "1",
        "--alpha", "0.5", "--no-transcript"]


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before {path} existed: "
                        f"{proc.communicate()[1]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"{path} did not appear within {seconds} s")
        time.sleep(0.05)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups")
def test_ctrl_c_during_training_exits_130_and_the_run_resumes(tmp_path, capsys):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the server
    process and its two workers. Before the fix typer turned the KeyboardInterrupt into a
    returned 130 that ``main`` dropped: exit 0, nothing on stderr."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "privfedcal", "train", *FAST, "--rounds", "100000",
         "--workers", "2", "--quiet", "--out", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)
    _wait_for(run / "checkpoint" / "meta.json", proc)  # training has started
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stopped_after = time.monotonic() - sent
    assert proc.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("privfedcal: error: interrupted") and "--resume" in lines[0]
    assert stopped_after < 30  # seconds, not the 100,000 rounds (a generous bound for CI)
    assert not (run / "summary.json").exists()
    done = json.loads((run / "checkpoint" / "meta.json").read_text())["round"]
    assert done >= 1 and f"round {done}" in lines[0]

    main(["train", "--resume", str(run), "--rounds", str(done + 1), "--threads", "1"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == done + 1
    history = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == list(range(1, done + 2))


@pytest.mark.parametrize("command", [
    ["train", *FAST, "--rounds", "2"],
    ["attack", "classes", "--run", "RUN"],
    ["partition", "--clients", "4"],
])
def test_keyboard_interrupt_in_any_command_is_one_line_130(command, tmp_path, capsys,
                                                          monkeypatch):
    """A KeyboardInterrupt raised inside a command (where Ctrl-C lands) ends as exit 130."""
    import privfedcal.attacks.reconstruction.runner
    import privfedcal.cli.run_progress
    import privfedcal.data.partition

    def stop(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(privfedcal.cli.run_progress, "execute", stop)
    monkeypatch.setattr(privfedcal.attacks.reconstruction.runner, "load_run", stop)
    monkeypatch.setattr(privfedcal.data.partition, "partition_indices", stop)
    args = [str(tmp_path) if a == "RUN" else a for a in command]
    code, out = run_cli([*args, "--out", str(tmp_path / "out")], capsys)
    assert code == 130, out
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert lines == ["privfedcal: error: interrupted"], out.err


def test_interrupt_before_the_first_round_keeps_nothing(tmp_path, capsys, monkeypatch):
    from privfedcal.federation.simulator import Simulator

    def stop(self, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulator, "_run", stop)
    run = tmp_path / "run"
    code, out = run_cli(["train", *FAST, "--rounds", "2", "--out", str(run)], capsys)
    assert code == 130
    assert out.err.strip().splitlines()[-1] == (
        "privfedcal: error: interrupted: no round had finished: nothing was kept")
    assert not run.exists()
