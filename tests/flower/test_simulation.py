"""The documented Flower commands beyond the deployment: the example app on Flower's
simulation engine (Ray), and a failing run that must leave no process behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from privfedcal.flower.deploy.localdeploy import (  # noqa: E402
    LocalDeployment,
    LocalSimulation,
    descendants,
    main,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.flower
@pytest.mark.slow
def test_example_on_the_simulation_engine(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "run"
    code = main(["simulate", str(EXAMPLE), "rounds=2", "clients=2", "alpha=0.5",
                 "local-epochs=1", "threads=1", f'out="{out}"'])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["accuracy"] > 0.6


@pytest.mark.flower
@pytest.mark.slow
@pytest.mark.parametrize("kind", [LocalDeployment, LocalSimulation])
def test_a_failed_run_leaves_no_process(kind, tmp_path):
    dep = kind(2, tmp_path)
    with dep:
        started = [p.pid for p in dep.procs]
        below = sum((descendants(p) for p in started), [])
        # a setting the app does not declare: `flwr run` refuses the run
        done = dep.run(EXAMPLE, {"no-such-setting": 1}, timeout=300)
        assert done.returncode != 0
    assert started and dep.alive() == []
    assert not any(_alive(pid) for pid in started + below)
