"""The Python API (privfedcal/api.py, docs/api.md): the page's examples run as doctests, the
exported names resolve and type-check, the functions give the CLI's numbers, and the DP
helper adds the noise opacus' accountant asks for."""

from __future__ import annotations

import doctest
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import privfedcal

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(clients=3, rounds=2, local_epochs=1, device="cpu", threads=1, alpha=0.5)


def test_the_api_page_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = doctest.testfile(str(ROOT / "docs" / "api.md"), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 20 and result.failed == 0


def test_every_exported_name_resolves_and_import_stays_cheap():
    from privfedcal import api

    assert set(privfedcal.__all__) - {"__version__"} <= set(api.__all__)
    for name in privfedcal.__all__:
        assert getattr(privfedcal, name) is not None
    with pytest.raises(AttributeError):
        privfedcal.no_such_name  # noqa: B018
    code = "import sys, privfedcal; print('privfedcal.api' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["False", "False"]


def test_the_api_is_type_checked():
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                           "--ignore-missing-imports", "--no-incremental",
                           "privfedcal/api.py", "privfedcal/pysurface.py", "privfedcal/ownloop.py",
                            "privfedcal/__init__.py"],
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


def test_privatize_statistics_adds_the_noise_opacus_plans():
    """One release at sample rate 1: sigma from opacus' RDP accountant, called directly;
    each key's std is sigma * sqrt(3 keys) * its sensitivity (1, clip, clip^2)."""
    from opacus.accountants.utils import get_noise_multiplier

    eps, delta, clip = 4.0, 1e-5, 2.0
    sigma = get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=1.0,
                                 steps=1, accountant="rdp", epsilon_tolerance=0.001)
    zeros = {"count": torch.zeros(20000, dtype=torch.float64),
             "sum": torch.zeros(200, 100, dtype=torch.float64),
             "outer": torch.zeros(20, 30, 30, dtype=torch.float64)}
    noisy = privfedcal.privatize_statistics(zeros, epsilon=eps, delta=delta, clip=clip)
    for key, sens in (("count", 1.0), ("sum", clip), ("outer", clip * clip)):
        want = sigma * math.sqrt(3) * sens
        assert float(noisy[key].std()) == pytest.approx(want, rel=0.05), key
    again = privfedcal.privatize_statistics(zeros, epsilon=eps, delta=delta, clip=clip)
    assert not torch.equal(noisy["sum"], again["sum"])  # fresh OS-entropy noise each call
    with pytest.raises(privfedcal.UsageError):
        privfedcal.privatize_statistics(zeros, epsilon=0.0, delta=delta, clip=clip)


def test_ccvr_statistics_match_numpy_and_clip():
    """Sums over features recomputed with numpy, and clipped rows have norm <= clip."""
    import numpy as np

    from privfedcal.models import create_model

    torch.manual_seed(0)
    model = create_model("mlp", num_classes=3, in_channels=1, image_size=8).eval()
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 3, (40,))
    with torch.no_grad():
        z = model.features(x).double().numpy()
    stats = privfedcal.ccvr_statistics(model, x, y, 3)
    for c in range(3):
        zc = z[y.numpy() == c]
        assert float(stats["count"][c]) == len(zc)
        np.testing.assert_allclose(stats["sum"][c].numpy(), zc.sum(0), rtol=1e-9)
        np.testing.assert_allclose(stats["outer"][c].numpy(), zc.T @ zc, rtol=1e-9)
    clip = float(np.linalg.norm(z, axis=1).min()) / 2  # every row is clipped
    clipped = privfedcal.ccvr_statistics(model, x, y, 3, clip=clip)
    # each row has norm clip, so the trace of outer is count * clip^2, to the precision of
    # the float32 features the rows are scaled in (a relative 1.4e-7 was seen: rtol 1e-6)
    traces = torch.diagonal(clipped["outer"], dim1=1, dim2=2).sum(1)
    torch.testing.assert_close(traces, clipped["count"] * clip * clip, rtol=1e-6, atol=0.0)
