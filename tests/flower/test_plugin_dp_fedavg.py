"""privfedcal.flower.plugin.PrivateUpdates: DP-FedAvg of the user's own strategy, charged to
the same ledger as the calibration release. examples/quickstart_private (the quickstart
shape with Flower's ``fixedclipping_mod`` on the nodes) over the in-process grid: the rounds'
charges and the calibration's are in one accountant per client, and summary.json's one
epsilon is their composition."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.grid import run_app  # noqa: E402
from privfedcal.privacy.accounting import compute_epsilon  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PRIVATE, CALIBRATED = EXAMPLES / "quickstart_private", EXAMPLES / "quickstart_calibrated"
ROUNDS = 2
FAST = {"num-server-rounds": ROUNDS, "privfedcal.rounds": ROUNDS}


def _run(app: Path, monkeypatch, tmp_path, overrides):
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "quickstart" or m.startswith("quickstart.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return run_app(app, 3, overrides)


@pytest.mark.flower
def test_the_rounds_and_the_calibration_share_one_ledger(monkeypatch, tmp_path):
    import torch

    torch.set_num_threads(1)
    _run(PRIVATE, monkeypatch, tmp_path, FAST)
    (run,) = (tmp_path / "runs").iterdir()
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    z = privacy["noise_multipliers"]
    rounds = [(z["dp-fedavg"], 1.0, 1)] * ROUNDS
    # the rounds' own epsilon: exactly the ROUNDS releases the wrapper charged
    assert privacy["user_dp"]["epsilon_spent"] == pytest.approx(
        compute_epsilon(rounds, "rdp", privacy["delta"]), rel=1e-9)
    # the one epsilon: the rounds, the clip's search and the calibration release composed
    everything = rounds + [(z[label], 1.0, 1) for label in z if label != "dp-fedavg"]
    assert privacy["epsilon_spent"] == pytest.approx(
        compute_epsilon(everything, "rdp", privacy["delta"]), rel=1e-9)
    assert privacy["epsilon_spent"] <= privacy["epsilon_target"] == 8.0
    assert set(privacy["per_client_epsilon"].values()) == {privacy["epsilon_spent"]}
    assert "user-level DP-FedAvg" in privacy["covers"]


@pytest.mark.flower
def test_more_rounds_than_planned_are_refused(monkeypatch, tmp_path):
    with pytest.raises(UsageError, match="more than privfedcal.rounds"):
        _run(PRIVATE, monkeypatch, tmp_path, {**FAST, "num-server-rounds": ROUNDS + 1})


def test_the_private_app_adds_a_few_lines_to_the_calibrated_one():
    """The change from quickstart_calibrated: the mod, the wrapper, calibrate's ``updates``
    and the run config's two keys (docs/flower.md shows them)."""
    from test_quickstart_example import added_and_removed

    added, removed = added_and_removed(CALIBRATED, PRIVATE)
    code = [a for a in added if not a.startswith("pyproject.toml")]
    assert any("fixedclipping_mod]" in a for a in code)
    assert any("PrivateUpdates(FedAvg(" in a for a in code)
    assert any("updates=strategy" in a for a in code)
    # 9 lines of code (5 of them replace lines), the name and 2 run-config keys
    assert (len(code), len(added) - len(code), len(removed)) == (9, 3, 6), (added, removed)
    docs = (EXAMPLES.parent / "docs" / "flower.md").read_text()
    shown = {line[1:].strip() for line in docs.splitlines() if line.startswith("+")}
    assert [a for a in added if a.split(": ", 1)[1] not in shown] == []
