"""The Python API (privfedcal/api/__init__.py, docs/api.md): the page's examples run as doctests, the
exported names resolve and type-check, the functions give the CLI's numbers, and the DP
helper adds the noise opacus' accountant asks for."""

from __future__ import annotations

import doctest
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import privfedcal

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(clients=3, rounds=2, local_epochs=1, device="cpu", threads=1, alpha=0.5)


def test_the_api_page_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = doctest.testfile(str(ROOT / "docs" / "api.md"), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 20 and result.failed == 0


def test_every_exported_name_resolves_and_import_stays_cheap():
    from privfedcal import api, jobs

    assert set(privfedcal.__all__) - {"__version__"} == set(api.__all__) | set(jobs.__all__)
    for name in privfedcal.__all__:
        assert getattr(privfedcal, name) is not None
    assert privfedcal.compare is jobs.compare and privfedcal.train is api.train
    with pytest.raises(AttributeError):
        privfedcal.no_such_name  # noqa: B018
    code = "import sys, privfedcal; print('privfedcal.api' in sys.modules or 'privfedcal.jobs' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["False", "False"]


def test_the_api_is_type_checked():
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                           "--ignore-missing-imports", "--no-incremental",
                           "privfedcal/api/__init__.py", "privfedcal/api/run.py", "privfedcal/api/attacking.py",
                           "privfedcal/api/attack_jobs.py", "privfedcal/api/log.py", "privfedcal/api/arguments.py",
                           "privfedcal/api/ownloop.py", "privfedcal/__init__.py"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_train_gives_the_clis_numbers(tmp_path, capsys):
    from privfedcal.cli.main import main

    run = privfedcal.train(method="ccvr", out=tmp_path / "api", **FAST)
    main(["train", "--method", "ccvr", "--clients", "3", "--rounds", "2", "--local-epochs",
          "1", "--device", "cpu", "--threads", "1", "--alpha", "0.5",
          "--out", str(tmp_path / "cli")])
    capsys.readouterr()
    cli = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert run.accuracy == cli["accuracy"]
    assert run.summary["per_class_accuracy"] == cli["per_class_accuracy"]
    # the same folder: every file and folder the CLI writes (accuracy.png included)
    assert sorted(p.name for p in run.path.iterdir()) == sorted(
        p.name for p in (tmp_path / "cli").iterdir())
    with pytest.raises(privfedcal.UsageError, match="already holds a run"):
        privfedcal.train(method="ccvr", out=tmp_path / "api", **FAST)


def test_resume_extends_a_run_like_an_uninterrupted_one(tmp_path):
    short = privfedcal.train(out=tmp_path / "short", **{**FAST, "rounds": 1})
    longer = privfedcal.resume(short, rounds=2)
    whole = privfedcal.train(out=tmp_path / "whole", **FAST)
    assert longer.accuracy == whole.accuracy and len(longer.metrics) == 2
    with pytest.raises(privfedcal.UsageError, match="already complete"):
        privfedcal.resume(longer)


def test_load_run_and_attack_refuse_bad_input(tmp_path):
    with pytest.raises(privfedcal.UsageError, match="not a run folder"):
        privfedcal.load_run(tmp_path)
    run = privfedcal.train(method="ccvr", out=tmp_path / "run", **FAST)
    with pytest.raises(privfedcal.UsageError, match="attack kind"):
        privfedcal.attack(run, "everything")
    with pytest.raises(privfedcal.UsageError, match=">= 1"):
        privfedcal.attack(run, "stats", steps=0)
    view = shutil.copytree(run.server_view, tmp_path / "view")
    seen = []
    records = privfedcal.attack(view, "stats", steps=3, restarts=1, clients=[0], classes=[1],
                                progress=seen.append)
    assert records and all(r.get("scored") is False for r in records)
    # progress counts optimisation steps up to the total, targets up to every record
    assert seen and seen[-1].steps == seen[-1].total > 0
    assert seen[-1].targets == seen[-1].of == len(records)
    assert [p.steps for p in seen] == sorted(p.steps for p in seen)
    with pytest.raises(privfedcal.UsageError, match="progress"):
        privfedcal.attack(view, "stats", steps=3, progress="print")


