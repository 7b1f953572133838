"""Disaggregation across rounds on the two runs of docs/results/privacy.md ("Disaggregation
across rounds"): what a server learns per client by differencing a run's secure sums.

Trains, through ``privfedcal train`` (the code of this checkout), unless ``--out`` already
holds them:

    creff:  --method creff --secagg --hide-counts --creff-weighting sample
    fedavg: --method fedavg --secagg-updates

both with ``--clients 4 --participation 0.5 --rounds 6 --threads 1`` (seed 0), then runs
``attack disaggregate`` on each with and without the public totals and prints, per run and
key, the participant sets, the clients determined, the finest group, the clients recovered
exactly, the worst-off client's largest absolute error and the mean relative error (the
results table's columns), and the seconds the attack itself took.

    python benchmarks/attacks/disaggregate.py --out /tmp/disaggregate [--rounds 6] [--clients 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.attacks.reconstruction.disaggregate_attack import (
    DisaggregateOptions,
    disaggregate_run,
    summarise,
)
from privfedcal.attacks.reconstruction.runner import load_run
from privfedcal.cli.main import main as cli

RUNS = {"creff": ["--method", "creff", "--secagg", "--hide-counts", "--creff-weighting",
                  "sample"],
        "fedavg": ["--method", "fedavg", "--secagg-updates"]}


def ensure(out: Path, name: str, args: argparse.Namespace) -> Path:
    run = out / name
    if not (run / "summary.json").exists():
        cli(["train", *RUNS[name], "--clients", str(args.clients), "--participation",
             str(args.participation), "--rounds", str(args.rounds), "--threads", "1",
             "--out", str(run)])
    return run


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def report(run: Path) -> dict:
    view = load_run(run)
    out = {}
    for totals in (True, False):
        t0 = time.perf_counter()
        records, _ = disaggregate_run(view, DisaggregateOptions(public_totals=totals))
        took = time.perf_counter() - t0
        print(f"{run.name} ({'with' if totals else 'without'} public totals, {took:.2f} s); "
              f"sums over {records[0]['participants']}")
        for r in summarise(records):
            print(f"  {r['label']:<13} {r['key']:<18} determined {r['determined']}/"
                  f"{r['clients']}  finest {fmt(r['finest_group'])}  total "
                  f"{r['public_total'] or 'none':<12} exact {fmt(r['exact'])}  worst-off "
                  f"{fmt(r['worst_client'])}: {fmt(r['worst_max_abs_error'])}  mean rel "
                  f"{fmt(r['mean_rel_error'])}  fit residual {fmt(r['fit_residual'])}")
        out["with public totals" if totals else "without public totals"] = {
            "seconds": took, "rows": summarise(records)}
    return out


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--participation", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=6)
    args = harness.parse(p)
    harness.finish(args, {name: report(ensure(args.out, name, args)) for name in RUNS})


if __name__ == "__main__":
    main()
