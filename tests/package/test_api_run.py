"""Runs from Python (privfedcal/api/__init__.py, privfedcal/api/log.py): in memory unless given a
folder, saved as the CLI's run folder, replaced only with ``overwrite`` and only when it is
a run folder; progress through the ``privfedcal`` logger, a bar when interactive, none with
``progress=False``, the caller's callable per round."""

from __future__ import annotations

import copy
import gc
import json
import logging
import re
import sys
import types

import pytest

import privfedcal
from privfedcal.api import log as api_log

FAST = dict(clients=3, rounds=2, local_epochs=1, threads=1, device="cpu")


def test_a_run_without_out_stays_in_memory_until_its_last_run_goes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = privfedcal.train(method="ccvr", progress=False, **FAST)
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    assert run.in_memory and run.config.output.out is None
    assert len(run.metrics) == 2 and 0 < run.accuracy <= 1
    assert run.summary["accuracy"] == run.accuracy
    assert (run.server_view / "transcript").is_dir()
    assert run.experiment().model is not None
    records = privfedcal.attack(run, "classes", progress=False)
    assert records and records[0]["accuracy"] == 1.0  # scored: the clients' side is there
    # resume extends it in the same temporary folder, which lives while either Run does
    longer = privfedcal.resume(run, rounds=3, progress=False)
    assert longer.in_memory and longer.path == run.path and len(longer.metrics) == 3
    root = run.scratch.path
    del run
    gc.collect()
    assert (longer.path / "summary.json").is_file()
    twin = copy.deepcopy(longer)  # a copy shares the folder and keeps it too
    del longer
    gc.collect()
    assert twin.accuracy > 0
    del twin
    gc.collect()
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []


def test_save_writes_a_run_folder_that_load_run_and_report_read(tmp_path, capsys):
    from privfedcal.cli.main import main

    run = privfedcal.train(method="ccvr", progress=False, **FAST)
    kept = run.save(tmp_path / "kept")
    assert not kept.in_memory and kept.path == tmp_path / "kept"
    assert (kept.path / "accuracy.png").is_file()  # drawn as privfedcal train draws it
    loaded = privfedcal.load_run(tmp_path / "kept")
    assert loaded.accuracy == run.accuracy and loaded.metrics == run.metrics
    # the saved settings name the folder they are in, at the top and in the server's view
    for folder in (kept.path, kept.server_view):
        assert json.loads((folder / "config.json").read_text())["out"] == str(kept.path)
    main(["report", str(kept.path)])
    assert "wrote" in capsys.readouterr().out and (kept.path / "report.html").is_file()
    with pytest.raises(privfedcal.UsageError, match="already holds a run"):
        run.save(tmp_path / "kept")
    (kept.path / "metrics.jsonl").write_text("{damaged\n")  # the copy's, undone below
    with pytest.raises(privfedcal.UsageError, match=r"metrics.jsonl:1 is not valid JSON"):
        kept.metrics  # noqa: B018
    again = run.save(tmp_path / "kept", overwrite=True)
    assert again.metrics == run.metrics
    assert run.save(run.path) is run
    with pytest.raises(privfedcal.UsageError, match="into itself"):
        run.save(run.path / "inner")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(privfedcal.UsageError, match="not"):
            run.save(other, overwrite=overwrite)
    assert (other / "mine.txt").read_text() == "keep me"


def test_an_out_that_holds_a_run_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "run"
    first = privfedcal.train(out=out, progress=False, **FAST)
    assert not first.in_memory and (out / "summary.json").is_file()
    with pytest.raises(privfedcal.UsageError, match="already holds a run"):
        privfedcal.train(out=out, progress=False, **FAST)
    (out / "stale.txt").write_text("from the first run")
    second = privfedcal.train(out=out, overwrite=True, progress=False,
                              **{**FAST, "rounds": 1})
    assert second.path == out and not (out / "stale.txt").exists()
    assert len(second.metrics) == 1


@pytest.mark.parametrize("content", ["a file of one's own", "summary.json", "link"])
def test_overwrite_never_removes_a_folder_that_is_not_a_run(tmp_path, content):
    folder = tmp_path / "mine"
    if content == "link":  # a link to a run folder: its target is not ours to remove
        target = tmp_path / "target"
        target.mkdir()
        (target / "config.json").write_text("{}")
        folder.symlink_to(target, target_is_directory=True)
    else:
        folder.mkdir()
        (folder / ("data.txt" if content.startswith("a file") else content)).write_text("x")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(privfedcal.UsageError, match="not a privfedcal run folder"):
        privfedcal.train(out=folder, overwrite=True, **FAST)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_the_logger_gets_start_rounds_and_end_and_nothing_is_printed(caplog, capfd):
    caplog.set_level(logging.INFO, logger="privfedcal")
    run = privfedcal.train(method="ccvr", **FAST)  # default progress, not interactive here
    assert capfd.readouterr() == ("", "")
    lines = [r.getMessage() for r in caplog.records if r.name == "privfedcal"]
    assert lines[0] == (f"ccvr on digits: 2 rounds, 3 clients -> memory (a temporary folder, "
                        f"{run.path})")
    rounds = [line for line in lines if ": round " in line]
    assert len(rounds) == len(run.metrics) == 2
    assert rounds[1].startswith(f"ccvr on digits: round 2/2: accuracy "
                                f"{run.metrics[1]['accuracy']:.4f}, test loss")
    before = run.summary["accuracy_before_calibration"]
    assert lines[-1].startswith("ccvr on digits: done in ")
    assert lines[-1].endswith(f"accuracy {run.accuracy:.4f} ({before:.4f} before calibration)")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "privfedcal")
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("privfedcal").handlers)


def test_the_bar_shows_when_interactive_and_not_with_progress_false(monkeypatch, capsys):
    monkeypatch.setattr(api_log, "interactive", lambda: True)
    privfedcal.train(**FAST)
    shown = capsys.readouterr().err  # rich's bar, drawn once at its end off a terminal
    assert "fedavg on digits" in shown and "2/2" in shown
    privfedcal.train(progress=False, **FAST)
    assert capsys.readouterr().err == ""


def test_a_progress_callable_gets_each_rounds_record_and_no_bar(monkeypatch, capsys):
    monkeypatch.setattr(api_log, "interactive", lambda: True)
    seen = []
    run = privfedcal.train(progress=seen.append, **FAST)
    assert [r["round"] for r in seen] == [1, 2]
    assert [r["accuracy"] for r in seen] == [m["accuracy"] for m in run.metrics]
    assert capsys.readouterr().err == ""
    with pytest.raises(privfedcal.UsageError, match="progress must be callable, True or False, got str"):
        privfedcal.train(progress="yes", **FAST)


def test_an_attack_draws_its_bar_over_optimisation_steps_and_logs(monkeypatch, capsys, caplog):
    caplog.set_level(logging.INFO, logger="privfedcal")
    run = privfedcal.train(method="ccvr", progress=False, **FAST)
    caplog.clear()
    records = privfedcal.attack(run, "stats", steps=3, restarts=1, clients=[0], classes=[1],
                                progress=True)
    shown = capsys.readouterr().err
    assert "attack stats" in shown  # the bar's name; the log lines name the run too
    # every step done, every target
    assert re.search(rf" (\d+)/\1 targets {len(records)}/{len(records)} ", shown)
    lines = [r.getMessage() for r in caplog.records if r.name == "privfedcal"]
    assert lines[0] == f"attack stats on {run.path}: started"
    assert lines[-1].startswith(f"attack stats on {run.path}: {len(records)} records in ")


class _Handle:
    """What IPython's ``display(..., display_id=True)`` returns: a display updated in place."""

    def __init__(self, data):
        self.shown = [data["text/plain"]]

    def update(self, data, raw=False):
        assert raw
        self.shown.append(data["text/plain"])


def test_in_a_notebook_the_bar_is_one_line_redrawn_in_place(monkeypatch):
    """A Jupyter kernel is IPython with a kernel: the stand-in modules give what the bar
    uses of it (``get_ipython().kernel`` and ``display`` with a display id)."""
    handles = []

    def display(data, raw=False, display_id=False):
        assert raw and display_id
        handles.append(_Handle(data))
        return handles[-1]

    shell = types.SimpleNamespace(kernel=object())
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell
    shown = types.ModuleType("IPython.display")
    shown.display = display
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", shown)
    assert api_log.in_notebook() and api_log.interactive()
    run = privfedcal.train(**FAST)
    (handle,) = handles
    assert handle.shown[0].startswith("fedavg on digits " + "░" * 24 + " 0/2")
    last = handle.shown[-1]
    assert last.startswith("fedavg on digits " + "█" * 24 + " 2/2  acc ")
    assert f"acc {run.metrics[-1]['accuracy']:.4f}" in last and "ETA" not in last
    shell.kernel = None  # IPython in a terminal: not a notebook
    assert not api_log.in_notebook()


def test_seconds_read_as_a_person_says_them():
    assert [api_log.seconds(s) for s in (None, 0.04, 9.94, 9.96, 59.4, 61, 3599.6, 7800)] == [
        "?", "0.0 s", "9.9 s", "10 s", "59 s", "1 min 1 s", "1 h 0 min", "2 h 10 min"]
