"""The full-budget CIFAR-10 rows, for a GPU: CIFAR-10-LT IF 100 in
CReFF's setting (FedAvg and CCVR from one run, CReFF from another; the authors' ResNet-8 and
recipe) and CCVR's Table 2 at alpha 0.1 and 0.05 (the CCVR/MOON CNN), each from its file in
configs/ with the paper's numbers printed beside ours.

    python benchmarks/accuracy/full_budget_rows.py --data /path/to/cifar10 --out runs-full [--device cuda]
    python benchmarks/accuracy/full_budget_rows.py --out runs-full --table

A finished run (summary.json present) is skipped, so the script can be re-started; each run
logs to OUT/NAME.log. On a 2-core CPU one of these runs takes days: the reduced-budget rows of
docs/results/fidelity.md come from benchmarks/accuracy/cifar10_runs.py instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

#: name -> (config file, paper numbers as "before -> after")
ROWS: dict[str, tuple[str, str]] = {
    "lt100-ccvr": ("configs/ccvr-cifar10lt-if100.toml", "FedAvg 56.17 -> CCVR 69.53"),
    "lt100-creff": ("configs/creff-cifar10lt-if100.toml", "CReFF 70.55"),
    "a0.1-ccvr": ("configs/ccvr-cifar10-a0.1.toml", "FedAvg 58.55 -> CCVR 62.68"),
    "a0.05-ccvr": ("configs/ccvr-cifar10-a0.05.toml", "FedAvg 52.33 -> CCVR 54.95"),
}


def run_all(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (config, _) in ROWS.items():
        if (args.out / name / "summary.json").exists():
            print(f"[skip] {name}: done", flush=True)
            continue
        cmd = [sys.executable, "-m", "privfedcal.cli.main", "train", "--config", config,
               "--dataset", f"imagefolder:{args.data}", "--device", args.device,
               "--workers", str(args.workers), "--out", str(args.out / name)]
        print(f"[run] {name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        with open(args.out / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"[done] {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)


def table(out: Path) -> None:
    print("| row | before calibration | after | paper | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for name, (_, paper) in ROWS.items():
        f = out / name / "summary.json"
        if not f.exists():
            print(f"| {name} | not run | | {paper} | |")
            continue
        s = json.loads(f.read_text())
        before = s.get("accuracy_before_calibration")
        after = s.get("accuracy")
        cells = ["" if v is None else f"{100 * v:.2f}" for v in (before, after)]
        print(f"| {name} | {cells[0]} | {cells[1]} | {paper} | {s.get('wall_seconds', 0):.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="CIFAR-10 image folders (train/, test/)")
    p.add_argument("--out", type=Path, default=Path("runs-full"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--table", action="store_true", help="print the results table and exit")
    args = p.parse_args()
    if args.table:
        table(args.out)
        return
    if not args.data:
        print("full_budget_rows.py: --data is required to run the rows", file=sys.stderr)
        sys.exit(2)
    run_all(args)


if __name__ == "__main__":
    main()
