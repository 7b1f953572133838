"""Batched vs one-at-a-time attacks: ``attack invert --stats`` / ``--gradients`` and the small
``audit``, timed in one process on the same runs.

Trains the quick digits runs of ``attack invert`` (CCVR and CReFF, 5 clients, alpha 0.3,
``--rounds`` rounds, one thread) through ``privfedcal.api.train`` unless ``--runs`` already
holds them, then runs each attack plan as the CLI does (``runner.execute``) twice: with
``attack_batch=1`` (every target alone, the old path) and with ``--attack-batch`` (targets
optimised together, ``attacks/reconstruction/engine.py``). The two must give the same reconstructions: it
prints per kind the wall time of each, ``speedup <x>``, mean and worst (lowest) PSNR of
each and the largest PSNR difference between the paired records. ``--audit`` also times
the attack part of one small audit setting per method (``audit.run_setting``'s plan:
known classes, no raw baseline, one client, two restarts) the same way.

    python benchmarks/attacks/batched_attacks.py --runs /tmp/attack-bench [--steps 24000] [--restarts 4]
        [--attack-batch 32] [--threads 1] [--audit]
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.api import train
from privfedcal.attacks.attack_options import options_from
from privfedcal.attacks.reconstruction.feature_inversion import (
    DEFAULT_ATTACK_BATCH,
    DEFAULT_MAX_STEPS,
)
from privfedcal.attacks.reconstruction.gradients_attack import GradientsOptions, plan_gradients
from privfedcal.attacks.reconstruction.runner import execute, load_run
from privfedcal.attacks.reconstruction.stats_attack import StatsOptions, plan_stats

QUICK = dict(dataset="digits", clients=5, alpha=0.3, local_epochs=1, threads=1)
QUICK_CREFF = dict(match_steps=50, retrain_steps=100)  # as api/attack_jobs.py's quick run


def ensure_run(root: Path, method: str, rounds: int, seed: int) -> Path:
    run = root / method
    if not (run / "summary.json").exists():
        train(method=method, rounds=rounds, seed=seed, out=run,
              calibration_params=QUICK_CREFF if method == "creff" else {}, **QUICK)
    return run


def compare(name: str, view, opts, kind: str) -> dict:
    """Plan once, execute one at a time and batched; print times, PSNRs, speedup."""
    plan = plan_stats(view, opts) if kind == "stats" else plan_gradients(view, opts)
    rows = {}
    for size in (1, opts.attack_batch):
        fresh = dataclasses.replace(plan, shared={})
        t0 = time.perf_counter()
        results = execute(fresh, attack_batch=size)
        rows[size] = time.perf_counter() - t0, [r.record for r in results]
    (t_seq, seq), (t_bat, bat) = rows[1], rows[opts.attack_batch]
    for label, t, recs in (("one-at-a-time", t_seq, seq), ("batched", t_bat, bat)):
        psnr = [r["psnr"] for r in recs if math.isfinite(r.get("psnr", math.nan))]
        conv = sum(bool(r.get("converged")) for r in recs)
        print(f"{name} {label:13s} targets {len(recs):3d}  {t:8.1f} s  mean PSNR "
              f"{sum(psnr) / len(psnr):.3f}  worst {min(psnr):.3f}  converged {conv}/{len(recs)}")
    diff = max(abs(a["psnr"] - b["psnr"]) for a, b in zip(seq, bat, strict=True))
    steps = sum(a.get("steps_run") != b.get("steps_run") for a, b in zip(seq, bat, strict=True))
    print(f"{name} speedup {t_seq / t_bat:.2f}  max |PSNR diff| {diff:.2e} dB  "
          f"stopping steps differ: {steps}")
    return {"targets": len(seq), "one_at_a_time_s": t_seq, "batched_s": t_bat,
            "speedup": t_seq / t_bat, "max_psnr_diff_db": diff, "stopping_steps_differ": steps}


def main() -> None:
    ap = harness.parser(__doc__, threads=1)
    ap.add_argument("--runs", type=Path, required=True, help="folder for the digits runs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=DEFAULT_MAX_STEPS)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--attack-batch", type=int, default=DEFAULT_ATTACK_BATCH)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--audit", action="store_true", help="also the small audit's attacks")
    args = harness.parse(ap)
    results = {}
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), steps cap {args.steps}, "
          f"restarts {args.restarts}, attack batch {args.attack_batch}")
    for kind, method in (("stats", "ccvr"), ("gradients", "creff")):
        view = load_run(ensure_run(args.runs, method, args.rounds, args.seed))
        options = StatsOptions if kind == "stats" else GradientsOptions  # each attack's own
        opts = options(steps=args.steps, restarts=args.restarts, seed=args.seed,
                       attack_batch=args.attack_batch)
        results[f"invert --{kind}"] = compare(f"invert --{kind}", view, opts, kind)
        if args.audit:  # the options audit.run_setting attacks with (AuditConfig defaults)
            audit = options_from(options, dict(
                steps=args.steps, restarts=2, raw_samples=0, seed=args.seed, default_clients=1,
                known_classes=True, attack_batch=args.attack_batch))
            results[f"audit {method}"] = compare(f"audit {method}", view, audit, kind)
    harness.finish(args, results)


if __name__ == "__main__":
    main()
