"""Calibration payloads on the worker pool: the same uploads and numbers as the serial loop."""

from __future__ import annotations

import pytest
import torch

import privfedcal.calibration  # noqa: F401  (registers the calibrators)
from privfedcal.calibration.ccvr import StatsTask
from privfedcal.experiment import build_simulator
from privfedcal.federation.hooks import CALIBRATORS
from privfedcal.federation.workers import balanced_shares


def test_balanced_shares_cover_every_position_once() -> None:
    shares = balanced_shares([5, 1, 9, 3, 3, 7], 2)
    flat = sorted(i for s in shares for i in s)
    assert flat == list(range(6))
    # largest first onto the lighter share (ties: the first): 9->A 7->B 5->B 3->A 3->A 1->B
    loads = sorted(sum([5, 1, 9, 3, 3, 7][i] for i in s) for s in shares)
    assert loads == [13, 15]
    assert all(s == sorted(s) for s in shares)
    assert balanced_shares([4], 3) == [[0]]


def _uploads_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_pool_collect_equals_serial_collect(tiny_cfg, tmp_path) -> None:
    cfg = tiny_cfg(method="ccvr", workers=2, threads=1)
    pooled = build_simulator(cfg, tmp_path / "pool")
    serial = build_simulator(cfg.replace(workers=1), tmp_path / "serial")
    task = StatsTask(num_classes=10)
    clients = [0, 1, 2, 3]
    try:
        pooled.trainer()
        calls: list = []
        original = pooled._trainer_obj.collect

        def spy(*a, **kw):
            calls.append(1)
            return original(*a, **kw)

        pooled._trainer_obj.collect = spy
        got = pooled.collect(task, clients, pooled.global_state, "t", 1)
        assert calls, "the pool did not compute the payloads"
    finally:
        pooled.close()
    want = serial.collect(task, clients, serial.global_state, "t", 1)
    _uploads_equal(got, want)


#: slow on two shared cores: CReFF re-trains its head every round; the oracle's features
#: are computed on the server, so the pool changes least for it
_SLOW_CALIBRATORS = {"creff", "oracle"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_CALIBRATORS else n
    for n in CALIBRATORS.names() if n != "none"])
def test_calibrated_run_same_numbers_with_workers(name, tiny_cfg, tmp_path) -> None:
    base = tiny_cfg(calibrate=name, threads=1, rounds=2)
    if name == "creff":
        base = base.replace(calibration_params={"match_steps": 5, "retrain_steps": 10})
    one = build_simulator(base, tmp_path / "one").run()
    two = build_simulator(base.replace(workers=2), tmp_path / "two").run()
    assert one["accuracy"] == two["accuracy"]
    assert one["per_class_accuracy"] == two["per_class_accuracy"]
    assert one["loss"] == two["loss"]


@pytest.mark.parametrize("workers", [1, 2])
def test_trainers_hand_states_to_consume_in_job_order(workers, tiny_cfg, tmp_path) -> None:
    """The ``Trainer`` contract the simulator relies on: with ``consume`` every new state is
    handed over in job order and the results hold empty dicts; without it, the same states
    come back in the results (in-process and worker-pool trainers alike)."""
    from privfedcal.federation.workers import TrainJob

    sim = build_simulator(tiny_cfg(workers=workers), tmp_path / f"w{workers}")
    trainer = sim.trainer()
    try:
        jobs = [TrainJob(c, sim.exp.parts[c], None) for c in (2, 0, 1)]
        plain = trainer.train(sim.global_state, jobs, 1)
        got: list = []
        consumed = trainer.train(sim.global_state, jobs, 1, consume=got.append)
    finally:
        sim.close()
    assert [r.state for r in consumed] == [{}, {}, {}]
    assert len(got) == 3
    for g, r in zip(got, plain, strict=True):
        assert set(g) == set(r.state) and all(torch.equal(g[k], r.state[k]) for k in g)
    assert [r.loss for r in consumed] == [r.loss for r in plain]


def test_only_multiprocessings_connection_errors_are_silenced_after_terminate() -> None:
    """After the pool is terminated, a stopped worker's broken connection (raised inside
    multiprocessing) is not printed; any other error still reaches the previous hook."""
    import multiprocessing.connection as mpc
    import sys

    from privfedcal.federation.workers import _quiet_connection_errors

    seen: list = []
    hook = _quiet_connection_errors(lambda *a: seen.append(a[0]))

    def broken():
        mpc.Client(("127.0.0.1", 1))  # connection refused, raised inside multiprocessing

    for raiser, expected in ((broken, []), (lambda: open("/nonexistent/x"), [OSError]),
                             (lambda: 1 / 0, [ZeroDivisionError])):
        seen.clear()
        try:
            raiser()
        except Exception:
            hook(*sys.exc_info())
        assert len(seen) == len(expected), (raiser, seen)
        assert all(issubclass(t, e) for t, e in zip(seen, expected, strict=True))


def test_default_threads_are_one_for_the_small_models(tiny_cfg, tmp_path, monkeypatch):
    """Small models train on one thread unless --threads says otherwise (a second thread
    buys nothing there and collapses on a busy machine); others share the cores."""
    import multiprocessing

    from privfedcal.federation.workers import default_threads

    monkeypatch.setattr(multiprocessing, "cpu_count", lambda: 8)
    assert default_threads(1, "mlp") == default_threads(2, "digits-cnn") == 1
    assert default_threads(1, "cnn") == 8 and default_threads(2, "resnet8") == 4
    assert default_threads(16, None) == 1
    sim = build_simulator(tiny_cfg(threads=None), tmp_path / "run")
    assert sim.exp.model_name == "mlp" and sim.threads == 1
    sim = build_simulator(tiny_cfg(threads=3), tmp_path / "run3")
    assert sim.threads == 3
