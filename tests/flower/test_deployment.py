"""A real Flower deployment on loopback: SuperLink + 2 SuperNodes as separate processes.

Started with Flower's own commands (``flower-superlink``, ``flower-supernode``, ``flwr run``,
insecure mode, free 127.0.0.1 ports, private ``FLWR_HOME``), it runs the example app
(examples/flower) with FedAvg for 2 rounds on digits and CCVR under CKKS secure aggregation
(client 0's node holds the secret key), then checks the result and that every process is
gone. Slow: Flower starts one ClientApp process per message (each imports torch), so on a
loaded 2-core machine a round takes tens of seconds; run it with ``-m flower``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from privfedcal.flower.deploy.localdeploy import LocalDeployment, descendants  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"
TIMEOUT = 480  # seconds for the whole run; measured ~2.5 min on a loaded 2-core machine


@pytest.mark.flower
@pytest.mark.slow
def test_fedavg_and_secure_ccvr_on_a_local_deployment(tmp_path):
    out = tmp_path / "run"
    dep = LocalDeployment(3, tmp_path)  # the key holder node needs 2 uploads besides its own
    started: list[int] = []
    try:
        with dep:
            started = [p.pid for p in dep.procs]
            done = dep.run(EXAMPLE, {"method": "ccvr", "secagg": True, "rounds": 2,
                                     "alpha": 0.5, "local-epochs": 1,
                                     "out": str(out), "flower.round-timeout": 300.0,
                                     "calibration-params.virtual-per-class": 50},
                           timeout=TIMEOUT)
            assert (out / "summary.json").exists(), (
                f"flwr run exited {done.returncode}\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}\n{dep.log_tail()}")
    finally:
        dep.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["calibrator"] == "ccvr"
    assert summary["accuracy"] > 0.6  # digits, 10 classes: chance is 0.1
    assert summary["calibration"]["virtual_features"] == 500
    index = json.loads((out / "server" / "transcript" / "index.json").read_text())
    views = {e["view"] for e in index if e["label"] == "ccvr-stats"}
    assert "plain-upload" not in views and {"ciphertext", "aggregate"} <= views
    assert summary["privacy"]["secagg"]["scheme"].startswith("CKKS")
    # every process we started, and everything they spawned, is gone
    assert started and dep.alive() == []
    assert all(not _alive(pid) for pid in started)
    assert all(not _alive(pid) for pid in sum((descendants(p) for p in started), []))


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie is not running


@pytest.mark.flower
@pytest.mark.slow
def test_a_killed_supernode_is_dropped_and_the_run_finishes(tmp_path):
    """3 SuperNodes, flower.min-replies 2: SuperNode 2 is killed (SIGKILL, as a machine
    that dies) once round 1 is done; the run finishes its 3 rounds with the other two and
    names client 2 in summary.json's dropped_clients."""
    import time

    out = tmp_path / "run"
    dep = LocalDeployment(3, tmp_path)
    try:
        with dep:
            run = dep.start_run(EXAMPLE, {"rounds": 3, "alpha": 0.5, "local-epochs": 1,
                                          "out": str(out), "flower.min-replies": 2,
                                          "flower.round-timeout": 120.0})
            log = tmp_path / "logs" / "flwr-run.log"
            deadline = time.monotonic() + TIMEOUT
            while "round 1: train loss" not in log.read_text(errors="replace"):
                assert run.poll() is None and time.monotonic() < deadline, (
                    log.read_text(errors="replace")[-3000:] + dep.log_tail())
                time.sleep(1)
            dep.kill_node(2)
            run.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert (out / "summary.json").exists(), (
                f"{log.read_text(errors='replace')[-3000:]}\n{dep.log_tail()}")
    finally:
        dep.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["accuracy"] > 0.5
    drops = summary["dropped_clients"]
    assert drops and {d["client"] for d in drops} == {2}
    assert {d["group"] for d in drops} <= {"2", "3"}
    assert dep.alive() == []
