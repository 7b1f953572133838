"""The randomized sweep: seeded fault schedules (``schedule.draw``) run and checked from
``server/`` alone. A short sweep runs with the default test command; a longer one is
marked slow. ``PRIVFEDCAL_FAULT_SEED`` moves the window of seeds; a failure prints the seed
and the schedule (replay: ``python -m tests.faults.soak --replay SEED``)."""

from __future__ import annotations

import os

import pytest

from .harness import run_schedule
from .schedule import PROTECTIONS, Schedule, draw

BASE = int(os.environ.get("PRIVFEDCAL_FAULT_SEED", "0"))
SHORT = 6  # schedules in the default run: about 30 s on one core
LONG = 60


def check_seed(seed: int, tmp_path) -> None:
    schedule = draw(seed)
    if schedule.engine == "flower":
        pytest.importorskip("flwr")
    pytest.importorskip("tenseal")
    out = run_schedule(schedule, tmp_path)
    assert not out.violations, (
        f"seed {seed} ({'; '.join(out.events)}): {schedule.describe()}\n"
        + "\n".join(str(v) for v in out.violations[:10]))


@pytest.mark.parametrize("seed", range(BASE, BASE + SHORT))
def test_short_sweep(seed, tmp_path):
    check_seed(seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(BASE + SHORT, BASE + SHORT + LONG))
def test_long_sweep(seed, tmp_path):
    check_seed(seed, tmp_path)


@pytest.mark.parametrize("name", ["creff-secagg-dp", "fedavg-dp-updates-secagg"])
def test_fault_free_runs_raise_no_false_alarm(name, tmp_path):
    """Without a fault the package keeps the guarantees these invariants check (isolation,
    charging, records): the harness does not cry wolf. The recomputed epsilon equals the
    reported one, so a checker that over-charges would fail here too."""
    pytest.importorskip("tenseal")
    from .accounting import recomputed

    settings = {**PROTECTIONS[name], "clients": 4, "participation": 0.5, "rounds": 3,
                "seed": 0, "data_seed": 0}
    out = run_schedule(Schedule(0, "simulator", settings, {"kind": "none"}), tmp_path)
    assert out.events[-1] == "train: finished", out.events
    assert [v for v in out.violations if v.invariant != "timing"] == []
    reported = out.view.privacy()["per_client_epsilon"]
    assert {str(c): pytest.approx(e) for c, e in recomputed(out.view).items()} == reported
