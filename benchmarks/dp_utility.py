"""Accuracy cost of DP on the calibration uploads, per epsilon (digits, 10 clients).

    python benchmarks/dp_utility.py [--seeds 0,1,2] [--eps 1,2,4,8,16,inf] [--secagg]
                                    [--methods ccvr,creff] [--weighting client|sample]

For each epsilon: FedAvg + CCVR (one release of class statistics) and FedAvg + CReFF
(one release of class gradients per round), Dirichlet alpha 0.1, default training settings.
Prints mean and std of the final accuracy over the seeds (and, for CCVR, the accuracy of
the uncalibrated model, which DP does not touch).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from privfedcal.config import RunConfig
from privfedcal.experiment import build_simulator


def run(method: str, eps: float, seed: int, secagg: bool, out: Path, rounds: int,
        weighting: str | None) -> dict:
    params = {"creff_weighting": weighting} if weighting else {}
    cfg = RunConfig(method=method, dp_eps=eps, seed=seed, secagg=secagg, device="cpu",
                    threads=1, transcript=False, rounds=rounds, calibration_params=params)
    return build_simulator(cfg, out).run()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eps", default="1,2,4,8,16,inf")
    ap.add_argument("--methods", default="ccvr,creff")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--secagg", action="store_true")
    ap.add_argument("--weighting", choices=["client", "sample"], default=None,
                    help="CReFF's --creff-weighting (default: the calibrator's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"| method | epsilon | accuracy (mean ± std, {len(seeds)} seeds) | before calibration |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            for e in args.eps.split(","):
                eps = math.inf if e == "inf" else float(e)
                accs, before = [], []
                for s in seeds:
                    out = Path(tmp) / f"{method}-{e}-{s}"
                    summ = run(method, eps, s, args.secagg, out, args.rounds, args.weighting)
                    accs.append(summ["accuracy"])
                    if "accuracy_before_calibration" in summ:
                        before.append(summ["accuracy_before_calibration"])
                b = f"{100 * np.mean(before):.2f}" if before else "-"
                print(f"| {method} | {e} | {100 * np.mean(accs):.2f} ± {100 * np.std(accs):.2f} "
                      f"| {b} |", flush=True)


if __name__ == "__main__":
    main()
