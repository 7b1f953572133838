"""examples/quickstart_plain and examples/quickstart_calibrated: a Flower app of one's own
(a CNN whose head is ``fc3``, DataLoaders, Flower's FedAvg) and the same app with
privfedcal's CCVR under DP, CKKS secure aggregation and hidden counts.

The calibrated app differs from the plain one by at most 10 added lines; run over the
in-process Grid it calibrates the FedAvg model with every protection on, and the accuracy
before and after calibration is recorded (``record_property``, printed with ``-s``). The slow
test runs the calibrated app on a real local deployment (SuperLink and SuperNodes).
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from privfedcal.flower.grid import run_app  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PLAIN, CALIBRATED = EXAMPLES / "quickstart_plain", EXAMPLES / "quickstart_calibrated"
NODES = 3  # secure aggregation under Flower needs three nodes at least (docs/flower.md)


def _files(root: Path) -> dict[str, list[str]]:
    return {str(p.relative_to(root)): p.read_text().splitlines()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def added_and_removed(a: Path, b: Path) -> tuple[list[str], list[str]]:
    """The non-blank lines the folder ``b`` adds to ``a`` and those it removes."""
    fa, fb = _files(a), _files(b)
    assert set(fa) == set(fb), "the two apps have the same files"
    added, removed = [], []
    for name in fa:
        for line in difflib.unified_diff(fa[name], fb[name], lineterm="", n=0):
            if line.startswith(("+++", "---")) or not line[1:].strip():
                continue
            if line[0] == "+":
                added.append(f"{name}: {line[1:].strip()}")
            elif line[0] == "-":
                removed.append(f"{name}: {line[1:].strip()}")
    return added, removed


def test_the_calibrated_app_adds_at_most_ten_lines():
    added, removed = added_and_removed(PLAIN, CALIBRATED)
    assert len(added) <= 10, "\n".join(added)
    assert removed == ['pyproject.toml: name = "quickstart-plain"']
    assert sum("privfedcal.flower.plugin import" in line for line in added) == 2
    assert any("CalibrationClient(" in line for line in added)
    assert any("calibrate(grid" in line for line in added)


def test_docs_show_the_whole_diff():
    """docs/flower.md's "Use it in your own Flower app" shows every added line as it is."""
    docs = (EXAMPLES.parent / "docs" / "flower.md").read_text()
    shown = {line[1:].strip() for line in docs.splitlines() if line.startswith("+")}
    added, _ = added_and_removed(PLAIN, CALIBRATED)
    assert [a for a in added if a.split(": ", 1)[1] not in shown] == []


def test_the_line_count_sees_a_change(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, body in ((a, "x = 1\n\ny = 2\n"), (b, "x = 1\n\n\nz = 3\ny = 2\n")):
        root.mkdir()
        (root / "m.py").write_text(body)
    assert added_and_removed(a, b) == (["m.py: z = 3"], [])


def _run(app: Path, monkeypatch, tmp_path, **overrides):
    """The app's ServerApp and ClientApp over the in-process grid, in ``tmp_path`` (the
    apps share their package name: the one imported before is forgotten first)."""
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "quickstart" or m.startswith("quickstart.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return run_app(app, NODES, overrides)


@pytest.mark.flower
def test_the_calibrated_app_over_the_in_process_grid(monkeypatch, tmp_path, record_property):
    import torch

    torch.set_num_threads(1)
    context = _run(CALIBRATED, monkeypatch, tmp_path)  # the app's config: 5 rounds
    (run,) = (tmp_path / "runs").iterdir()  # calibrate's run folder (runs/flower-plugin-...)
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["accuracy_before_calibration"], summary["accuracy"]
    record_property("accuracy_before_calibration", before)
    record_property("accuracy_after_calibration", after)
    print(f"quickstart_calibrated, 3 nodes, 5 rounds: FedAvg {before:.3f}, "
          f"after calibration {after:.3f}")
    assert context.state["quickstart"]["accuracy"] == pytest.approx(before)
    privacy = summary["privacy"]
    assert privacy["epsilon_spent"] <= privacy["epsilon_target"] == 8.0
    assert privacy["secagg"]["scheme"].startswith("CKKS") and privacy["hide_counts"]
    assert summary["rejected_uploads"] == [] and summary["dropped_clients"] == []
    # label-skewed digits: FedAvg's head is far off, the calibrated one much better (0.357
    # -> 0.62-0.69 over four noise draws, docs/flower.md)
    assert after > before + 0.1
    # the app's own checkpoint is the calibrated model, under its own names
    state = torch.load(tmp_path / "final_model.pt")
    assert "fc3.weight" in state and "classifier.weight" not in state


@pytest.mark.flower
@pytest.mark.slow
def test_the_plain_app_over_the_in_process_grid(monkeypatch, tmp_path):
    context = _run(PLAIN, monkeypatch, tmp_path)
    assert 0.1 < context.state["quickstart"]["accuracy"] < 1
    assert not (tmp_path / "runs").exists()  # nothing of privfedcal's runs here


@pytest.mark.flower
@pytest.mark.slow
def test_the_calibrated_app_on_a_local_deployment(capsys, monkeypatch, tmp_path):
    from privfedcal.flower.deploy.localdeploy import main

    monkeypatch.chdir(tmp_path)
    code = main(["deploy", str(CALIBRATED), "--nodes", str(NODES), "--timeout", "1200"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    before = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    after = float(re.search(r"after calibration: ([\d.]+)", out).group(1))
    print(f"quickstart_calibrated on SuperLink + {NODES} SuperNodes, 5 rounds: FedAvg "
          f"{before:.3f}, after calibration {after:.3f}")
    assert after > before
