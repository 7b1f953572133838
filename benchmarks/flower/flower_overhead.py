"""Per-round wall time under Flower against the in-process simulator, same workload.

Ways to run the same config (same seeds, same clients, same SGD steps):

* ``simulator``: privfedcal's in-process round loop (the reference);
* ``loopback``: the real ServerApp and ClientApp, messages serialised to Flower's wire
  objects and back, all in this process (the cost of the message layer alone; the Grid is
  ``privfedcal.flower.grid.InProcessGrid``);
* ``deployment``: a SuperLink and one SuperNode per client as processes on loopback, started
  with Flower's own commands (``flwr run``); Flower starts a ClientApp process per message,
  which imports torch and rebuilds the client's data every time;
* ``deployment-warm``: the same with privfedcal's warm launcher (``flower/warm.py``): every
  ClientApp process is forked from a server that has imported torch, Flower and privfedcal;
* ``deployment-warm-short-idle``: BENCHMARK ONLY, not a way to run: ``deployment-warm`` with
  Flower's SuperNode patched in this benchmark's node processes to sleep 0.2 s instead of
  its hard-coded 3 s between empty pulls, to measure what that sleep costs;
* ``deployment-warm-hold``: ``deployment-warm`` with ``flower.hold`` = ``--hold`` seconds
  (default 0.5): a ``query.hold`` message behind every message keeps each SuperNode busy
  until the next one is there, instead of its 3 s idle sleep (``flower/link.py``);
* ``clientapp-startup``: what one cold ClientApp process spends before its message.

Seconds per round are the server's own ``seconds`` of each round (training, aggregation,
evaluation), median over rounds. For the deployment modes a breakdown follows: our train
handler per message (``PRIVFEDCAL_CLIENTAPP_TIMING`` lines in the SuperNodes' logs), the
warm ClientApp process from fork to exit (the server's log), and the rest, Flower's share.

    python benchmarks/flower/flower_overhead.py [--clients 2] [--rounds 3] [--images 0]
        [--modes simulator,loopback,deployment,deployment-warm] [--threads 1]

``--images N`` (> 0) swaps the 1.8k-image digits set for N random CIFAR-shaped images and
the CCVR/MOON CNN, so that local training, not process start-up, dominates a round.
Prints seconds per round per mode and the ratios mode / simulator.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cifar_like, harness
import harness
from cifar_like import make_npz

from privfedcal.settings.run_config import RunConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"


def per_round(history: list[dict]) -> float:
    return float(statistics.median(h["seconds"] for h in history))


def run_simulator(cfg: RunConfig, out: Path) -> float:
    from privfedcal.experiment import build_simulator

    sim = build_simulator(cfg.replace(out=str(out)), out)
    sim.run()
    return per_round(sim.history)


def run_loopback(cfg: RunConfig, out: Path) -> float:
    from flwr.app import Context, RecordDict

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.grid import InProcessGrid
    from privfedcal.flower.records import to_run_config
    from privfedcal.flower.server_app import run_server

    run_config = to_run_config(cfg.replace(out=str(out)))
    grid = InProcessGrid(client_app, run_config, cfg.data.clients)
    sim, _ = run_server(grid, Context(run_id=1, node_id=1, node_config={},
                                      state=RecordDict(), run_config=run_config))
    return per_round(sim.history)


#: per deployment mode, what its logs say about the ClientApp processes (``breakdown``)
DETAILS: dict[str, dict[str, list[float]]] = {}


#: BENCHMARK ONLY, never for a real deployment: a SuperNode whose idle sleep between pulls
#: (Flower 1.41 ``start_client_internal``: ``time.sleep(3)``) is IDLE_SLEEP seconds, by
#: swapping the ``time`` module that function sees; measures what that sleep costs a round
_SHORT_IDLE = """
import sys, time, types
import flwr.supernode.start_client_internal as sci
from flwr.supernode.cli import flower_supernode
fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
fake.sleep = lambda s: time.sleep(IDLE if s == 3 else s)  # only the idle sleep is 3 s
sci.time = fake
sys.argv[0] = "flower-supernode"
flower_supernode()
"""
IDLE_SLEEP = 0.2


def patched_node_deployment(base: type) -> type:
    """``base`` (LocalDeployment) whose SuperNodes idle IDLE_SLEEP s instead of 3 s."""
    import sys

    class ShortIdle(base):  # type: ignore[misc, valid-type]
        def _start(self, name, args):  # noqa: ANN001, ANN202
            if args[0] == "flower-supernode":
                code = _SHORT_IDLE.replace("IDLE if", f"{IDLE_SLEEP!r} if")
                args = [sys.executable, "-c", code, *args[1:]]
            return super()._start(name, args)

    return ShortIdle


#: ``flower.hold`` of the ``deployment-warm-hold`` mode (``--hold``)
HOLD = {"seconds": 0.5}


def run_deployment(cfg: RunConfig, out: Path, warm: bool = False,
                   short_idle: bool = False, hold: float = 0.0) -> float:
    from privfedcal.flower.client_app import TIMING_ENV
    from privfedcal.flower.deploy.localdeploy import LocalDeployment
    from privfedcal.flower.records import to_run_config

    overrides = {k: v for k, v in to_run_config(cfg.replace(out=str(out))).items()
                 if "." not in k and v != ""}
    if hold:
        overrides["flower.hold"] = hold
    work = out.parent / "deployment"
    kind = patched_node_deployment(LocalDeployment) if short_idle else LocalDeployment
    dep = kind(cfg.data.clients, work, warm=warm)
    dep.env[TIMING_ENV] = "1"  # each handler's seconds, in the SuperNodes' logs
    with dep:
        done = dep.run(EXAMPLE, overrides, timeout=3600)
        if not (out / "metrics.jsonl").exists():
            raise RuntimeError(f"flwr run failed ({done.returncode}):\n{done.stderr[-2000:]}\n"
                               + dep.log_tail())
    mode = "deployment-warm" if warm else "deployment"
    mode += "-short-idle" if short_idle else "-hold" if hold else ""
    DETAILS[mode] = read_logs(dep.logs)
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"{mode}: rounds " + " ".join(f"{h['seconds']:.2f}" for h in history) + " s",
          flush=True)
    summary = json.loads((out / "summary.json").read_text()) \
        if (out / "summary.json").exists() else {}
    if "flower_holds" in summary:
        print(f"{mode}: holds {summary['flower_holds']}", flush=True)
    return per_round(history)


def read_logs(logs: Path) -> dict[str, list[float]]:
    """Seconds per ClientApp message from the logs: ``handler`` and ``build`` (our code,
    ``privfedcal-clientapp timing`` lines) and, warm, ``process`` (fork to exit, the
    server's ``child ... after S s`` lines)."""
    got: dict[str, list[float]] = {"handler": [], "build": [], "process": []}
    for log in logs.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "privfedcal-clientapp timing: train" in line:
                got["handler"].append(float(line.split(" handler ")[1].split(" s")[0]))
                got["build"].append(float(line.split("experiment build ")[1].split(" s")[0]))
            elif line.startswith("child ") and " after " in line:
                got["process"].append(float(line.split(" after ")[1].split(" s")[0]))
    return got


def breakdown(mode: str, seconds: dict[str, float]) -> None:
    """Where a deployment round's time goes: the work (the simulator's round), our code in
    the ClientApp beyond it, and the rest (Flower: scheduling, polling, process start)."""
    got = DETAILS.get(mode)
    if not got or "simulator" not in seconds or not got["handler"]:
        return
    over = seconds[mode] - seconds["simulator"]
    handler, build = statistics.median(got["handler"]), statistics.median(got["build"])
    print(f"breakdown {mode}: {seconds[mode]:.2f} s/round = simulator {seconds['simulator']:.2f}"
          f" s + {over:.2f} s over it; a node's train handler (ours, median of "
          f"{len(got['handler'])}) {handler:.2f} s, of which the experiment build {build:.2f} s")
    if got["process"]:
        process = statistics.median(got["process"])
        print(f"  warm ClientApp process, fork to exit (median of {len(got['process'])}): "
              f"{process:.2f} s, of which outside our handler (Flower) "
              f"{max(process - handler, 0.0):.2f} s")
    print(f"  Flower's share (the round minus the slower node's handler, roughly): "
          f"{max(seconds[mode] - handler, 0.0):.2f} s/round")


_STARTUP = """
import resource, sys, time
t0 = time.perf_counter()
def lap(name):
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{name}: wall {time.perf_counter() - t0:.2f} s, cpu {r.ru_utime + r.ru_stime:.2f} s",
          flush=True)
import torch
lap("import torch")
import flwr.clientapp
lap("+ import flwr.clientapp")
import privfedcal.flower.client_app as ca
lap("+ import privfedcal.flower.client_app")
from flwr.app import Context, RecordDict
from privfedcal.flower.records import to_run_config
from privfedcal.settings.run_config import RunConfig
cfg = RunConfig.of(**eval(sys.argv[1]))
ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0,
              "num-partitions": cfg.data.clients}, state=RecordDict(),
              run_config=to_run_config(cfg))
ca.client_runtime(ctx)
lap("+ the client's experiment (data, partition, model)")
"""


def run_clientapp_startup(cfg: RunConfig, out: Path) -> float:
    """What one ClientApp process of a deployment spends before its first message: a fresh
    process importing torch, Flower and privfedcal's ClientApp, then building the client's
    experiment. Printed cumulatively; returns the total wall seconds."""
    import subprocess
    import sys

    fields = {k: v for k, v in cfg.to_dict().items() if v is not None
              and k not in ("method_params", "calibration_params")}
    fields["dp_eps"] = float("inf")
    done = subprocess.run([sys.executable, "-c", _STARTUP, repr(fields).replace("inf", "1e999")],
                          capture_output=True, text=True, check=True)
    print(done.stdout, end="")
    return float(done.stdout.strip().splitlines()[-1].split("wall ")[1].split(" s")[0])


def run_deployment_warm(cfg: RunConfig, out: Path) -> float:
    return run_deployment(cfg, out, warm=True)


def run_deployment_warm_short_idle(cfg: RunConfig, out: Path) -> float:
    """Benchmark only: the warm deployment with Flower's SuperNode idle sleep patched."""
    return run_deployment(cfg, out, warm=True, short_idle=True)


def run_deployment_warm_hold(cfg: RunConfig, out: Path) -> float:
    return run_deployment(cfg, out, warm=True, hold=HOLD["seconds"])


MODES = {"simulator": run_simulator, "loopback": run_loopback, "deployment": run_deployment,
         "deployment-warm": run_deployment_warm,
         "deployment-warm-short-idle": run_deployment_warm_short_idle,
         "deployment-warm-hold": run_deployment_warm_hold,
         "clientapp-startup": run_clientapp_startup}


def main() -> None:
    ap = harness.parser(__doc__, threads=1)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--images", type=int, default=0, help="0: digits; N: random CIFAR-shaped")
    ap.add_argument("--method", default="fedavg")
    ap.add_argument("--modes", default="simulator,loopback,deployment")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="work in DIR and keep it (the deployments' logs), not a temp folder")
    ap.add_argument("--hold", type=float, default=HOLD["seconds"],
                    help="flower.hold of the deployment-warm-hold mode (seconds)")
    args = harness.parse(ap)
    HOLD["seconds"] = args.hold
    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) if args.keep is None else args.keep
        tmp_path.mkdir(parents=True, exist_ok=True)
        data = {"dataset": "digits"}
        if args.images > 0:
            npz = make_npz(tmp_path / "cifar-shaped.npz", args.images)
            data = {"dataset": f"npz:{npz}", "model": "cnn", "augment": False}
        cfg = RunConfig.of(method=args.method, clients=args.clients, rounds=args.rounds,
                        local_epochs=args.local_epochs, partition="iid", device="cpu",
                        threads=args.threads, transcript=False, seed=0, **data)
        seconds: dict[str, float] = {}
        for mode in modes:
            t0 = time.perf_counter()
            seconds[mode] = MODES[mode](cfg, tmp_path / mode / "run")
            print(f"{mode:>11}: {seconds[mode]:8.3f} s/round   "
                  f"(whole run incl. start-up {time.perf_counter() - t0:.1f} s)", flush=True)
    if "simulator" in seconds:
        for mode in modes:
            if mode != "simulator":
                print(f"ratio {mode} / simulator: {seconds[mode] / seconds['simulator']:.2f}")
        for mode in modes:
            breakdown(mode, seconds)
    harness.finish(args, {"seconds_per_round": seconds})


if __name__ == "__main__":
    main()
