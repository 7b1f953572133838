"""Wall time of classifier calibration against one federated training round.

CCVR (Luo et al., NeurIPS 2021) runs once after training: client statistics on every client,
Gaussian fit + sampling, head re-training (``CCVR.after_training``). CReFF (Shang et al.,
IJCAI 2022) runs every round: client class gradients (Eq. 3) on the selected clients, then
server gradient matching (Eq. 5-6) and head re-training (Eq. 7) (``CReFF.after_round``).

Workload: the CCVR/MOON CNN (d = 256) on CIFAR-shaped random data written to a temporary
``npz:`` file (32x32x3 uint8, 10 classes), 10 clients, CPU, one thread, no augmentation, the
``privfedcal train`` defaults otherwise (2 local epochs, batch 32, full participation, CReFF
m = 100, I = 100, J = 300).

    python benchmarks/calibration/calibration_cost.py [--images 5000] [--rounds 3] [--partition iid]
        [--threads 1] [--profile]

Prints the training round, CCVR's ``after_training`` and CReFF's ``after_round`` split into
client-side work (``ctx.collect``: feature extraction + payload on every client, summed over
clients) and the server rest, and the two ratios against the round (targets with
``--workers 2``: CCVR <= 15%, CReFF <= 20%). Every time is the fastest of its repeats (training rounds of the FedAvg run
and the training part of the CReFF run's rounds; ``--repeats`` CCVR calibrations of the same
model; CReFF's rounds), the usual estimate on a machine shared with other work. ``--profile`` adds a cProfile
breakdown of both (cumulative seconds of the main functions).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cifar_like, harness
import harness
from cifar_like import make_npz

from privfedcal.experiment import build_calibrator, build_experiment
from privfedcal.federation.local import make_generator
from privfedcal.federation.simulator import RoundContext, Simulator
from privfedcal.privacy.planner import build_uplink
from privfedcal.settings.run_config import RunConfig

#: functions whose cumulative time the --profile breakdown prints
PROFILED = ("collect", "extract_features", "from_features", "compute", "per_sample_head_grads",
            "sample_virtual_features", "retrain_classifier", "retrain_head_of",
            "class_mean_grads", "grad", "evaluate", "eigh")


class TimedSimulator(Simulator):
    """A simulator that records the wall time of every ``collect`` and of every test pass
    (``evaluate`` calls that the simulator's kept last evaluation does not answer)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.timings: list[tuple[str, int, float]] = []  # (what, round, seconds)

    def collect(self, task, clients, state, label, round_):  # type: ignore[override]
        t0 = time.perf_counter()
        out = super().collect(task, clients, state, label, round_)
        self.timings.append((f"collect:{label}", round_, time.perf_counter() - t0))
        return out

    def evaluate(self, state, transform=None):  # type: ignore[override]
        kept = self._last_eval
        t0 = time.perf_counter()
        out = super().evaluate(state, transform)
        if self._last_eval is not kept:  # a test pass, not the kept result
            self.timings.append(("evaluate", -1, time.perf_counter() - t0))
        return out

    def spent(self, what: str, round_: int | None = None) -> float:
        return sum(s for w, r, s in self.timings if w == what and (round_ is None or r == round_))


def simulator(cfg: RunConfig, run_dir: Path) -> TimedSimulator:
    exp = build_experiment(cfg)
    calibrator = build_calibrator(cfg, exp)
    return TimedSimulator(exp, run_dir, calibrator=calibrator,
                          uplink=build_uplink(cfg, exp, calibrator))


def posthoc_context(sim: Simulator) -> RoundContext:
    """The context ``Simulator.finish`` hands a post-hoc calibrator."""
    cfg = sim.loop
    rounds = cfg.training.rounds
    return RoundContext(sim, rounds, sim.global_state, sim.global_state,
                        list(range(cfg.data.clients)),
                        make_generator(cfg.training.seed, rounds, 0, 5))


def profile(fn, top: int = 25) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, _nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if name in PROFILED and ("privfedcal" in file or name in ("grad", "eigh")):
            rows.append((ct, f"{Path(file).name}:{line}:{name}"))
    for ct, where in sorted(rows, reverse=True):
        print(f"    {ct:8.3f} s  {where}")
    print("  top functions by own time:")
    st.sort_stats("tottime").print_stats(8)


def main() -> None:
    ap = harness.parser(__doc__, threads=1)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1,
                    help="worker processes for training and the client payloads")
    ap.add_argument("--repeats", type=int, default=3, help="CCVR calibrations to time")
    ap.add_argument("--profile", action="store_true")
    args = harness.parse(ap)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        npz = make_npz(tmp / "data.npz", args.images)
        base = RunConfig.of(dataset=f"npz:{npz}", model="cnn", clients=args.clients,
                         partition=args.partition, alpha=0.5, rounds=args.rounds,
                         local_epochs=args.local_epochs, device="cpu", threads=args.threads,
                         eval_every=10**6, transcript=False, augment=False,
                         workers=args.workers)

        fedavg = simulator(base, tmp / "fedavg")
        fedavg.run()
        # the last round also evaluates the test set: left out of the training rounds
        train_rounds = [h["seconds"] for h in fedavg.history[:-1]]

        ccvr_runs = []
        fedavg.trainer()  # in a run the pool is up from training when CCVR starts
        for _ in range(args.repeats):
            ccvr = build_calibrator(base.replace(calibrate="ccvr"), fedavg.exp)
            # as in a run: the final round has just evaluated the global model (CCVR's
            # "before"), and the summary reuses CCVR's evaluation of the calibrated model
            fedavg.evaluate(fedavg.global_state)
            fedavg.timings.clear()
            t0 = time.perf_counter()
            info = ccvr.after_training(posthoc_context(fedavg))
            ccvr_runs.append((time.perf_counter() - t0, fedavg.spent("collect:ccvr-stats"),
                              fedavg.spent("evaluate")))
        fedavg.close()
        ccvr_s, ccvr_client, ccvr_eval = min(ccvr_runs)
        evals = sum(1 for w, _r, _s in fedavg.timings if w == "evaluate")
        ccvr_median = statistics.median(r[0] for r in ccvr_runs)

        creff_sim = simulator(base.replace(method="creff"), tmp / "creff")
        creff_sim.run()
        creff_runs = []
        for h in creff_sim.history:
            total = h["calibration"]["seconds"]
            creff_runs.append((total, creff_sim.spent("collect:creff-grad", h["round"])))
            if h["round"] < args.rounds:   # CReFF's rounds train exactly what FedAvg's do
                train_rounds.append(h["seconds"] - total)
        creff_s, creff_client = min(creff_runs)
        creff_median = statistics.median(r[0] for r in creff_runs)
        round_s = min(train_rounds)
        round_median = statistics.median(train_rounds)

        n = args.images * args.local_epochs
        print("load average (1, 5, 15 min) at the end: "
              f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} ({os.cpu_count()} CPUs)")
        print(f"CNN d=256, {args.images} CIFAR-shaped images, {args.clients} clients "
              f"({args.partition}), {args.local_epochs} local epochs, batch 32, "
              f"{args.threads} thread(s) x {args.workers} worker(s), CPU")
        print(f"training round (fastest of {len(train_rounds)}): {round_s:.3f} s "
              f"({n / round_s:,.0f} img/s)")
        print(f"CCVR after_training (fastest of {len(ccvr_runs)}): {ccvr_s:.3f} s = client statistics {ccvr_client:.3f} s "
              f"+ {evals} test pass(es) {ccvr_eval:.3f} s + fit/sample/re-train "
              f"{ccvr_s - ccvr_client - ccvr_eval:.3f} s ({info['calibration']['virtual_features']} "
              f"virtual features, {info['calibration']['retrain_steps']} steps)")
        print(f"CReFF after_round (fastest of {len(creff_runs)}): {creff_s:.3f} s = client "
              f"gradients {creff_client:.3f} s + server matching and re-training "
              f"{creff_s - creff_client:.3f} s")
        print(f"ratio CCVR / round  = {ccvr_s / round_s:.3f}   (target <= 0.15 with --workers 2; without the "
              f"evaluations {(ccvr_s - ccvr_eval) / round_s:.3f})")
        print(f"ratio CReFF / round = {creff_s / round_s:.3f}   (target <= 0.20 with --workers 2; client part "
              f"{creff_client / round_s:.3f}, server part {(creff_s - creff_client) / round_s:.3f})")

        print(f"medians: round {round_median:.3f} s, CCVR {ccvr_median:.3f} s "
              f"({ccvr_median / round_median:.3f} of a round), CReFF {creff_median:.3f} s "
              f"({creff_median / round_median:.3f} of a round)")

        if args.profile:
            print("\nprofile: CCVR after_training (cumulative seconds)")
            profile(lambda: build_calibrator(base.replace(calibrate="ccvr"), fedavg.exp)
                    .after_training(posthoc_context(fedavg)))
            print("\nprofile: one CReFF after_round (cumulative seconds)")
            ctx = RoundContext(creff_sim, args.rounds, creff_sim.global_state,
                               creff_sim.global_state, list(range(args.clients)),
                               make_generator(0, args.rounds + 1, 0, 4))
            profile(lambda: creff_sim.calibrator.after_round(ctx))
    harness.finish(args, {
        "training_round_s": {"rounds": train_rounds, "min": round_s, "median": round_median},
        "ccvr_after_training_s": {"min": ccvr_s, "median": ccvr_median,
                                  "client_statistics": ccvr_client, "test_passes": ccvr_eval},
        "creff_after_round_s": {"min": creff_s, "median": creff_median,
                                "client_gradients": creff_client},
        "ccvr_per_round": ccvr_s / round_s, "creff_per_round": creff_s / round_s})


if __name__ == "__main__":
    main()
