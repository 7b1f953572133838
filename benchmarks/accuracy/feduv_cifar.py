"""FedUV on CIFAR-10 beside FedAvg, Freeze, MOON and FedProx, and FedUV's ablation (only L_U,
only L_V; paper Table 4), at Dirichlet alpha 0.01 and 1.0 (the paper's label-shift settings).

Each row is one ``privfedcal train`` command (printed, and logged beside its run folder); a
finished run (its folder holds summary.json) is skipped, so the grid can be re-started
(``harness.run_grid``). ``--json PATH`` also writes the runs' exit codes and seconds, or the
table's rows, with the machine line.

    python benchmarks/accuracy/feduv_cifar.py --data /work/data/cifar10 --out runs-feduv --budget reduced
    python benchmarks/accuracy/feduv_cifar.py --out runs-feduv --table

Settings (FedUV sec. 4.1): the authors' small CNN with its BN projector (``uv-cnn``, 256
units), 10 clients, full participation, SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch
128 (the authors' default); FedUV lambda = D/4 = 2.5 and mu = 0.5; FedProx mu = 0.01; MOON
mu = 1 (tau 0.5). Only L_U is ``--lam 0``, only L_V is ``--mu 0``.
``--budget full`` is the paper's E = 10 and 100 rounds (their STL-10 count; a GPU job);
``--budget reduced`` is 5 rounds x 1 local epoch, for a 2-core CPU. Rows run in the order
below: the FedAvg / FedUV pairs first, since they answer whether FedUV helps at all.
Not reproduced: the authors' cosine learning-rate decay over rounds and their 90/10
train-validation split (the test set is the CIFAR-10 test set, as in every run here).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

BUDGETS = {
    "reduced": "--rounds 5 --local-epochs 1",
    "full": "--rounds 100 --local-epochs 10",
}
COMMON = ("--model uv-cnn --clients 10 --partition dirichlet --batch-size 128 --lr 0.01 "
          "--momentum 0.9 --weight-decay 1e-5")
METHODS = {
    "fedavg": "--method fedavg",
    "feduv": "--method feduv --mu 0.5 --lam 2.5",
    "freeze": "--method freeze",
    "moon": "--method moon --mu 1",
    "fedprox": "--method fedprox --mu 0.01",
    "feduv-only-lu": "--method feduv --mu 0.5 --lam 0",
    "feduv-only-lv": "--method feduv --mu 0 --lam 2.5",
}
ALPHAS = ("0.01", "1.0")


def grid() -> dict[str, str]:
    """name -> method and partition flags, most informative rows first."""
    rows = {}
    order = [("fedavg", "feduv")] + [(m,) for m in METHODS if m not in ("fedavg", "feduv")]
    for group in order:
        for alpha in ALPHAS:
            for method in group:
                rows[f"a{alpha}-{method}"] = f"{METHODS[method]} --alpha {alpha}"
    return rows


def command(name: str, flags: str, args: argparse.Namespace) -> list[str]:
    return ([sys.executable, "-m", "privfedcal.cli.main", "train",
             "--dataset", f"imagefolder:{args.data}", "--workers", str(args.workers),
             "--threads", str(args.threads), "--seed", str(args.seed),
             "--out", str(args.out / name)]
            + shlex.split(f"{COMMON} {BUDGETS[args.budget]} {flags}"))


def run_all(args: argparse.Namespace) -> dict:
    return harness.run_grid(args.out, {
        name: command(name, flags, args) for name, flags in grid().items()
        if not args.only or any(o in name for o in args.only)})


def table(out: Path) -> dict:
    print("| row | accuracy (%) | wall s |")
    print("| --- | --- | --- |")
    rows = {}
    for name, s in harness.summaries(out, grid()).items():
        if s is None:
            print(f"| {name} | not run | |")
            continue
        rows[name] = {"accuracy": s["accuracy"], "wall_seconds": s.get("wall_seconds")}
        print(f"| {name} | {100 * s['accuracy']:.2f} | {s.get('wall_seconds', 0):.0f} |")
    return rows


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--data", help="CIFAR-10 image folders (train/, test/)")
    p.add_argument("--out", type=Path, default=Path("runs-feduv"))
    p.add_argument("--budget", choices=sorted(BUDGETS), default="reduced")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", nargs="*", help="run only rows whose name contains one")
    p.add_argument("--table", action="store_true", help="print the results table and exit")
    args = harness.parse(p)
    if args.table:
        harness.finish(args, {"rows": table(args.out)})
        return
    if not args.data:
        print("feduv_cifar.py: --data is required to run the grid", file=sys.stderr)
        sys.exit(2)
    harness.finish(args, {"runs": run_all(args)})


if __name__ == "__main__":
    main()
