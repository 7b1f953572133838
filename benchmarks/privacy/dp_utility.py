"""Accuracy cost of DP on the calibration uploads, per epsilon (digits, 10 clients).

    python benchmarks/privacy/dp_utility.py [--seeds 0,1,2] [--eps 1,2,4,8,16,inf] [--secagg]
                                    [--methods ccvr,creff] [--weighting client|sample]
                                    [--jobs N]

For each epsilon: FedAvg + CCVR (one release of class statistics) and FedAvg + CReFF
(class gradients released in the rounds of its schedule: under DP by default the last
``creff.DP_RELEASE_LAST`` rounds, every sample of a class, docs/privacy/dp-uploads.md), Dirichlet
alpha 0.1, default training settings, one torch thread per run, ``--jobs`` runs at a time.
Prints, per method and epsilon, the accuracy of every seed, their mean and std, the largest
epsilon any client spent, and (for CCVR) the accuracy of the uncalibrated model, which DP
does not touch; then the machine (CPUs, load average) it ran on.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.experiment import build_simulator
from privfedcal.settings.run_config import RunConfig


def run(method: str, eps: float, seed: int, secagg: bool, out: Path, rounds: int,
        weighting: str | None) -> dict:
    torch.set_num_threads(1)
    params = {"creff_weighting": weighting} if weighting else {}
    cfg = RunConfig.of(method=method, dp_eps=eps, seed=seed, secagg=secagg, device="cpu",
                    threads=1, transcript=False, rounds=rounds, calibration_params=params)
    return build_simulator(cfg, out).run()


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eps", default="1,2,4,8,16,inf")
    ap.add_argument("--methods", default="ccvr,creff")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--secagg", action="store_true")
    ap.add_argument("--weighting", choices=["client", "sample"], default=None,
                    help="CReFF's --creff-weighting (default: the calibrator's)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    args = harness.parse(ap)
    rows = []
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = [(m, e, s) for m in args.methods.split(",") for e in args.eps.split(",")
            for s in seeds]
    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs) as pool:
        futures = {(m, e, s): pool.submit(
            run, m, math.inf if e == "inf" else float(e), s, args.secagg,
            Path(tmp) / f"{m}-{e}-{s}", args.rounds, args.weighting) for m, e, s in grid}
        print(f"| method | epsilon | accuracy per seed ({', '.join(map(str, seeds))}) | "
              f"mean ± std | epsilon spent (worst client) | before calibration |")
        print("| --- | --- | --- | --- | --- | --- |")
        for m in args.methods.split(","):
            for e in args.eps.split(","):
                sums = [futures[(m, e, s)].result() for s in seeds]
                accs = [100 * x["accuracy"] for x in sums]
                before = [100 * x["accuracy_before_calibration"] for x in sums
                          if "accuracy_before_calibration" in x]
                spent = [x.get("privacy", {}).get("epsilon_spent")
                         for x in sums]
                spent = [v for v in spent if v is not None]
                print(f"| {m} | {e} | {' / '.join(f'{a:.2f}' for a in accs)} "
                      f"| {np.mean(accs):.2f} ± {np.std(accs):.2f} "
                      f"| {f'{max(spent):.3f}' if spent else '-'} "
                      f"| {f'{np.mean(before):.2f}' if before else '-'} |", flush=True)
                rows.append({"method": m, "epsilon": e, "seeds": seeds, "accuracy": accs,
                             "epsilon_spent_worst": max(spent) if spent else None,
                             "accuracy_before_calibration": before})
    print(f"\n{len(grid)} runs, {args.jobs} at a time, {time.time() - t0:.0f} s on "
          f"{os.cpu_count()} CPUs; load average (1 min) {load0[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    harness.finish(args, {"rows": rows, "seconds": time.time() - t0})


if __name__ == "__main__":
    main()
