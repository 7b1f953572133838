"""Same seeds, same numbers: the Flower apps against the in-process simulator.

The ServerApp and ClientApp run for real over a ``LoopbackGrid`` (every message serialised
to Flower's wire objects and back); the aggregated global model after the last round, the
evaluation and the calibrated model must equal the simulator's. One thread everywhere, so
equality is exact up to float addition order, which is the same by construction.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")

import privfedcal.calibration  # noqa: E402, F401  (registers the calibrators)
from privfedcal.algorithms import ALGORITHMS  # noqa: E402
from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.federation.hooks import CALIBRATORS  # noqa: E402

TOL = 1e-6


def assert_same_state(a, b, tol=TOL):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=tol, msg=k)


def test_fedavg_two_rounds_equals_simulator(flower_cfg, run_simulator, run_flower):
    cfg = flower_cfg(method="fedavg")
    sim, summary = run_simulator(cfg)
    fl, fl_summary, grid = run_flower(cfg)
    assert_same_state(fl.global_state, sim.global_state)
    assert summary["accuracy"] == pytest.approx(fl_summary["accuracy"], abs=1e-12)
    assert [h["train_loss"] for h in fl.history] == pytest.approx(
        [h["train_loss"] for h in sim.history], abs=1e-9)
    assert fl_summary["accuracy"] > 0.6  # it trained (chance is 0.1)
    # two rounds x two clients, each way at least one float32 model
    model_bytes = sum(v.numel() * v.element_size() for v in sim.global_state.values())
    assert grid.bytes_sent >= 4 * model_bytes and grid.bytes_received >= 4 * model_bytes


@pytest.mark.parametrize("method", sorted(set(ALGORITHMS.names()) - {"fedavg"}))
def test_every_method_matches_simulator(method, flower_cfg, run_simulator, run_flower):
    cfg = flower_cfg(method=method, clients=3, participation=0.67, rounds=2)
    sim, _ = run_simulator(cfg)
    fl, _, grid = run_flower(cfg)
    assert_same_state(fl.global_state, sim.global_state)
    # per-client state never leaves the node: the server holds none
    assert fl.client_states == {}
    if method == "moon":  # the previous local model persisted in the nodes' context.state
        kept = [c.state.array_records.get("privfedcal.client-state") for c in grid.contexts.values()]
        assert sum(k is not None for k in kept) == len(sim.client_states) >= 2


#: small server-side settings per calibrator (a calibrator not listed runs its defaults)
SMALL_CALIBRATION = {"ccvr": {"virtual_per_class": 20},
                     "creff": {"features_per_class": 10, "match_steps": 5, "retrain_steps": 20}}


@pytest.mark.parametrize("name", [n for n in CALIBRATORS.names() if n != "none"])
def test_calibrators_match_simulator(name, flower_cfg, run_simulator, run_flower):
    cfg = flower_cfg(calibrate=name, calibration_params=SMALL_CALIBRATION.get(name, {}))
    if not CALIBRATORS.get(name).protectable:  # reads pooled raw data: no federated form
        with pytest.raises(UsageError, match="no federated form"):
            run_flower(cfg)
        return
    sim, summary = run_simulator(cfg)
    fl, fl_summary, _ = run_flower(cfg)
    assert_same_state(fl.global_state, sim.global_state)
    assert_same_state(fl.calibrator.eval_state(fl.global_state),
                      sim.calibrator.eval_state(sim.global_state), tol=1e-5)
    assert fl_summary["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-9)
    if name == "ccvr":
        assert fl_summary["calibration"]["virtual_features"] == 200
        assert fl_summary["accuracy_before_calibration"] == pytest.approx(
            summary["accuracy_before_calibration"], abs=1e-12)
    if name == "creff":  # the per-round matching saw the same aggregated gradients
        for a, b in zip(fl.history, sim.history, strict=True):
            assert a["calibration"]["match_loss_before"] == pytest.approx(
                b["calibration"]["match_loss_before"], abs=1e-6)

