"""The full-budget CIFAR-10 rows, for a GPU: CIFAR-10-LT IF 100 in
CReFF's setting (FedAvg and CCVR from one run, CReFF from another; the authors' ResNet-8 and
recipe) and CCVR's Table 2 at alpha 0.1 and 0.05 (the CCVR/MOON CNN), each from its file in
configs/ with the paper's numbers printed beside ours.

    python benchmarks/accuracy/full_budget_rows.py --data /path/to/cifar10 --out runs-full [--device cuda]
    python benchmarks/accuracy/full_budget_rows.py --out runs-full --table

A finished run (summary.json present) is skipped, so the script can be re-started; each run
logs to OUT/NAME.log (``harness.run_grid``). ``--json PATH`` also writes the runs' exit codes
and seconds, or the table's rows, with the machine line (its device: the GPU's name). On a 2-core CPU one of these runs takes days: the reduced-budget rows of
docs/results/fidelity.md come from benchmarks/accuracy/cifar10_runs.py instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

#: name -> (config file, paper numbers as "before -> after")
ROWS: dict[str, tuple[str, str]] = {
    "lt100-ccvr": ("configs/ccvr-cifar10lt-if100.toml", "FedAvg 56.17 -> CCVR 69.53"),
    "lt100-creff": ("configs/creff-cifar10lt-if100.toml", "CReFF 70.55"),
    "a0.1-ccvr": ("configs/ccvr-cifar10-a0.1.toml", "FedAvg 58.55 -> CCVR 62.68"),
    "a0.05-ccvr": ("configs/ccvr-cifar10-a0.05.toml", "FedAvg 52.33 -> CCVR 54.95"),
}


def run_all(args: argparse.Namespace) -> dict:
    return harness.run_grid(args.out, {
        name: [sys.executable, "-m", "privfedcal.cli.main", "train", "--config", config,
               "--dataset", f"imagefolder:{args.data}", "--device", args.device,
               "--workers", str(args.workers), "--out", str(args.out / name)]
        for name, (config, _) in ROWS.items()})


def table(out: Path) -> dict:
    print("| row | before calibration | after | paper | wall s |")
    print("| --- | --- | --- | --- | --- |")
    rows = {}
    for name, s in harness.summaries(out, ROWS).items():
        paper = ROWS[name][1]
        if s is None:
            print(f"| {name} | not run | | {paper} | |")
            continue
        before = s.get("accuracy_before_calibration")
        after = s.get("accuracy")
        rows[name] = {"accuracy_before_calibration": before, "accuracy": after, "paper": paper,
                      "wall_seconds": s.get("wall_seconds")}
        cells = ["" if v is None else f"{100 * v:.2f}" for v in (before, after)]
        print(f"| {name} | {cells[0]} | {cells[1]} | {paper} | {s.get('wall_seconds', 0):.0f} |")
    return rows


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--data", help="CIFAR-10 image folders (train/, test/)")
    p.add_argument("--out", type=Path, default=Path("runs-full"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--table", action="store_true", help="print the results table and exit")
    args = harness.parse(p)
    if args.table:
        harness.finish(args, {"rows": table(args.out)})
        return
    if not args.data:
        print("full_budget_rows.py: --data is required to run the rows", file=sys.stderr)
        sys.exit(2)
    harness.finish(args, {"runs": run_all(args)})


if __name__ == "__main__":
    main()
