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


def test_the_server_clips_sums_noises_and_divides_by_the_nodes_asked():
    """``private_average``: an update past the clip is clipped on the server (a node that
    skipped ``fixedclipping_mod`` moves the sum by the clip at most), a non-finite one counts
    as zero, the noise is the plan's ``N(0, (z S)^2)`` and the divisor the nodes asked."""
    import torch

    from privfedcal.flower.plugin.dp_fedavg import plan_updates, private_average
    from privfedcal.flower.plugin.plugin_settings import gather, resolve
    from privfedcal.privacy.noise import noise_generator
    from privfedcal.privacy.user_dp import UserDP, gaussian_vector

    s = resolve(gather({"dp_eps": 8.0, "dp_clip": 1.0, "dp_updates": True, "rounds": 2}, {}),
                clients=3)
    user_dp = plan_updates(s, 300).find(UserDP)
    user_dp.seeded = True  # the draws reproducible here; a run draws from OS entropy
    glob = {"w": torch.zeros(4), "b": torch.ones(2)}
    far = {"w": torch.tensor([10.0, 0, 0, 0]), "b": torch.ones(2)}        # norm 10: clipped
    near = {"w": torch.zeros(4), "b": torch.tensor([1.5, 1.0])}          # norm 0.5: kept
    broken = {"w": torch.full((4,), float("nan")), "b": torch.ones(2)}   # summed as zero
    new = private_average(user_dp, glob, [far, near, broken], round_=1)
    clip, m = user_dp.clip, user_dp.denominator
    assert (clip, m) == (1.0, 3)
    noise = gaussian_vector(6, user_dp.noise_multiplier * clip,
                            noise_generator(user_dp.seed, 1, -1, 302, seeded=True))
    summed = torch.tensor([1.0, 0, 0, 0, 0.5, 0], dtype=torch.float64) + noise
    torch.testing.assert_close(new["w"].double(), summed[:4] / m, rtol=0, atol=1e-6)
    torch.testing.assert_close(new["b"].double(), 1 + summed[4:] / m, rtol=0, atol=1e-6)
