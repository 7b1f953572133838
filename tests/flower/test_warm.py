"""The warm ClientApp launcher: the ``flwr-clientapp`` shim and ``privfedcal-clientapp-server``.

The shim falls back to the real ``flwr-clientapp`` when no server listens (or its socket
folder is not private), passes the ClientApp's exit status through, and a ClientApp forked by
the server dies with its shim. The end-to-end test runs a deployment (SuperLink + 2
SuperNodes on loopback) whose every ClientApp process is forked by the server and checks the
run equals the simulator's on the same seeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from privfedcal.flower.deploy import warm, warm_child  # noqa: E402
from privfedcal.flower.deploy.clientapp_shim import SOCKET_ENV  # noqa: E402
from privfedcal.flower.pulls import PULL_INITIAL_BACKOFF, PULLERS, quick_object_pulls  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"
REPO = str(Path(__file__).resolve().parents[2])
# Flower retries a Runtime API it cannot reach for minutes: a ClientApp that stays alive
HANGING = ["--runtime-api-address", "127.0.0.1:9", "--token", "t", "--insecure"]


def _env(sock: Path) -> dict[str, str]:
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", **{SOCKET_ENV: str(sock)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture
def shim(tmp_path):
    return warm.install_shim(tmp_path / "bin")


@pytest.fixture
def server(tmp_path):
    """A running server on a private socket; yields (socket path, its log file)."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    sock, log = folder / "server.sock", tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "privfedcal.flower.deploy.warm", "--socket",
                                 str(sock)], stdout=out, stderr=subprocess.STDOUT,
                                env=_env(sock), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while warm.ping(str(sock)) != proc.pid:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield sock, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not sock.exists()  # removed on SIGTERM


def _run(shim: Path, args: list[str], sock: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(shim), *args], capture_output=True, text=True, env=_env(sock),
                          timeout=120)


def test_forked_children_draw_fresh_random_state():
    """A fork copies the server's generators: each child must reseed from the OS, as a
    fresh process would, or every ClientApp would draw the same numbers."""
    import torch

    def child_draws() -> list[float]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                import random

                warm_child.fresh_process_state()
                os.write(write, json.dumps([torch.rand(()).item(), random.random()]).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as f:
            draws = json.loads(f.read())
        assert os.waitpid(pid, 0)[1] == 0
        return draws

    first, second = child_draws(), child_draws()
    assert first[0] != second[0] and first[1] != second[1]


def test_shim_without_server_runs_the_real_clientapp(shim, tmp_path):
    sock = tmp_path / "nobody" / "server.sock"
    done = _run(shim, ["--help"], sock)
    assert done.returncode == 0 and "usage: flwr-clientapp" in done.stdout
    bad = _run(shim, ["--no-such-flag"], sock)
    assert bad.returncode == 2 and "usage: flwr-clientapp" in bad.stderr


def test_shim_refuses_a_socket_folder_others_can_enter(shim, server, tmp_path):
    sock, log = server
    sock.parent.chmod(0o755)
    try:
        done = _run(shim, ["--help"], sock)
    finally:
        sock.parent.chmod(0o700)
    assert done.returncode == 0 and "usage: flwr-clientapp" in done.stdout
    assert "not using the warm server" in done.stderr and "mode 755" in done.stderr
    assert "child " not in log.read_text()  # started cold: nothing was forked


def test_warm_shim_passes_the_exit_status_through(shim, server):
    sock, log = server
    ok = _run(shim, ["--help"], sock)
    assert ok.returncode == 0 and "usage: flwr-clientapp" in ok.stdout
    bad = _run(shim, ["--no-such-flag"], sock)
    assert bad.returncode == 2 and "flwr-clientapp: error" in bad.stderr
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("child ")]
    assert [ln.split(" after")[0].split(": ")[1] for ln in lines] == ["exit 0", "exit 2"]


def test_a_killed_shim_takes_its_clientapp_along(shim, server):
    sock, log = server
    proc = subprocess.Popen([str(shim), *HANGING], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(sock))
    try:
        children = _wait_for_child(sock)
        assert len(children) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _alive(children[0]):
            assert time.monotonic() < deadline, "the forked ClientApp outlived its shim"
            time.sleep(0.1)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while "exit -9" not in log.read_text():  # reaped by the server
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_a_signal_to_the_shim_reaches_its_clientapp(shim, server):
    sock, log = server
    proc = subprocess.Popen([str(shim), *HANGING], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(sock))
    try:
        children = _wait_for_child(sock)
        assert len(children) == 1
        time.sleep(1.0)  # let Flower install its signal handlers in the child
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)  # returns once the child has ended
    finally:
        proc.kill()
    assert not _alive(children[0])
    ended = [ln for ln in log.read_text().splitlines() if ln.startswith(f"child {children[0]}:")]
    assert len(ended) == 1
    status = int(ended[0].split("exit ")[1].split(" ")[0])
    assert code == (status if status >= 0 else 128 - status)


def _wait_for_child(sock: Path) -> list[int]:
    server = warm.ping(str(sock))
    deadline = time.monotonic() + 60
    while True:
        kids = [int(p) for p in Path(f"/proc/{server}/task/{server}/children").read_text().split()]
        if kids or time.monotonic() > deadline:
            return kids
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.flower
@pytest.mark.slow
@pytest.mark.parametrize("hold", [0.0, 0.2], ids=["no-hold", "hold"])
def test_a_warm_deployment_equals_the_simulator(tmp_path, tiny_cfg, hold):
    """... and with flower.hold, whose holds then all run forked and all replies are
    pulled (the run summary counts them)."""
    from privfedcal.experiment import build_simulator
    from privfedcal.flower.deploy.localdeploy import LocalDeployment
    from privfedcal.flower.records import to_run_config

    cfg = tiny_cfg(clients=2, rounds=2, data_seed=7)
    sim_out = tmp_path / "simulator"
    sim = build_simulator(cfg.replace(out=str(sim_out)), sim_out)
    summary = sim.run()

    out = tmp_path / "deployment" / "run"
    overrides = {k: v for k, v in to_run_config(cfg.replace(out=str(out), data_seed=None)).items()
                 if "." not in k and v != ""}
    if hold:
        overrides["flower.hold"] = hold
    dep = LocalDeployment(2, tmp_path / "deployment", warm=True, data_seed=7)
    try:
        with dep:
            done = dep.run(EXAMPLE, overrides, timeout=480)
            assert (out / "summary.json").exists(), (
                f"flwr run exited {done.returncode}\n{done.stderr[-3000:]}\n{dep.log_tail()}")
            served = (dep.logs / "clientapp-server.log").read_text()
    finally:
        dep.stop()
    assert dep.alive() == []
    # every ClientApp ran forked from the server: the hello and 2 rounds, on 2 nodes
    assert served.count(": exit 0 after") >= 2 * 3 * (2 if hold else 1)
    assert ": exit 1" not in served
    fl_summary = json.loads((out / "summary.json").read_text())
    assert ("flower_holds" in fl_summary) == bool(hold)
    assert fl_summary["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-9)
    fl_history = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["train_loss"] for h in fl_history] == pytest.approx(
        [h["train_loss"] for h in sim.history], abs=1e-9)


def test_quick_object_pulls_makes_the_first_retry_short(monkeypatch):
    """A forked ClientApp asks for its message's objects while its SuperNode is still
    fetching them: the first retry waits PULL_INITIAL_BACKOFF, not Flower's 1 s, and a
    ClientApp's pull hands that on to Flower's retry loop."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    for name in PULLERS:  # Flower's own default, whatever an earlier test's ServerApp set
        fn = getattr(iu, name)
        monkeypatch.setattr(fn, "__kwdefaults__", {**fn.__kwdefaults__, "initial_backoff": 1})
    assert quick_object_pulls() == list(PULLERS)
    assert [getattr(iu, n).__kwdefaults__["initial_backoff"] for n in PULLERS] == \
        [PULL_INITIAL_BACKOFF] * len(PULLERS)
    seen = {}

    def fake_pull(ids, pull_fn, **kw):
        seen.update(kw)
        raise LookupError("stop after the pull")

    monkeypatch.setattr(iu, "pull_objects", fake_pull)
    with pytest.raises(LookupError):
        iu.pull_and_inflate_object_from_tree(iu.ObjectTree(object_id="0" * 64, children=[]),
                                             lambda _: b"", lambda _: None)
    assert seen["initial_backoff"] == PULL_INITIAL_BACKOFF < 1


def test_quick_object_pulls_leaves_another_flower_alone(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils

    monkeypatch.setattr(inflatable_utils, "pull_and_inflate_object_from_tree",
                        lambda tree, pull, confirm: None)
    monkeypatch.setattr(inflatable_utils, "pull_objects", lambda ids, pull: None)
    assert quick_object_pulls() == []


def test_preload_sets_quick_object_pulls(monkeypatch):
    calls = []
    monkeypatch.setattr(warm, "quick_object_pulls", lambda: calls.append(1) or ["x"])
    warm.preload(["json"])
    assert calls == [1]
