"""The CIFAR-10 experiments of docs/results/fidelity.md, run one after another on this CPU.

Each experiment is one ``privfedcal train`` command (printed and logged); a finished run
(its folder holds summary.json) is skipped, so the script can be re-started after an
interruption (``harness.run_grid``). ``--table`` prints the results as the markdown rows of
docs/results/fidelity.md; ``--json PATH`` also writes the runs' exit codes and seconds, or the
table's rows, with the machine line (``harness.finish``).

    python benchmarks/accuracy/cifar10_runs.py --data /path/to/cifar10 --out runs-cifar [--only cnn]
    python benchmarks/accuracy/cifar10_runs.py --out runs-cifar --table

``--data`` is CIFAR-10 as image folders (``train/<class>/*.png|jpg``, ``test/<class>/*``).
The oracle rows re-calibrate the final model of the matching CCVR run with real features
(the same trained model; only the post-hoc step differs), so they cost seconds, not a run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

#: reduced budget for a 2-core CPU (the papers: 100-200 rounds, E = 10 on a GPU)
CNN = ("--model cnn --clients 10 --partition dirichlet --rounds 20 --local-epochs 2 "
       "--batch-size 64 --lr 0.01 --momentum 0.9 --weight-decay 1e-5")
RESNET8_LT = ("--model resnet8 --clients 20 --participation 0.4 --partition longtail "
              "--alpha 0.5 --rounds 15 --local-epochs 2 --batch-size 32 --lr 0.01 "
              "--momentum 0.9 --weight-decay 1e-5")

EXPERIMENTS: dict[str, str] = {
    # (a) CCVR Table 2 setting: the CNN, 10 clients, Dirichlet alpha
    "cnn-a0.5-ccvr": f"--method ccvr {CNN} --alpha 0.5",
    "cnn-a0.1-ccvr": f"--method ccvr {CNN} --alpha 0.1",
    "cnn-a0.05-ccvr": f"--method ccvr {CNN} --alpha 0.05",
    # (b) CReFF's CIFAR-10-LT setting with the authors' ResNet-8
    "lt100-resnet8-ccvr": f"--method ccvr {RESNET8_LT} --imbalance-factor 100",
    "lt100-resnet8-creff": f"--method creff {RESNET8_LT} --imbalance-factor 100",
    # (a, continued) local regularisers at alpha 0.1
    "cnn-a0.1-fedprox": f"--method fedprox --calibrate ccvr {CNN} --alpha 0.1 --mu 0.01",
    "cnn-a0.1-moon": f"--method moon --calibrate ccvr {CNN} --alpha 0.1 --mu 1",
    "cnn-a0.1-feduv": f"--method feduv --calibrate ccvr {CNN} --alpha 0.1",
    "lt50-resnet8-ccvr": f"--method ccvr {RESNET8_LT} --imbalance-factor 50",
    "lt50-resnet8-creff": f"--method creff {RESNET8_LT} --imbalance-factor 50",
}
ORACLES = {"cnn-a0.5-oracle": "cnn-a0.5-ccvr", "cnn-a0.1-oracle": "cnn-a0.1-ccvr",
           "cnn-a0.05-oracle": "cnn-a0.05-ccvr"}


def command(name: str, data: str, out: Path, workers: int) -> list[str]:
    return ([sys.executable, "-m", "privfedcal.cli.main", "train", "--dataset", f"imagefolder:{data}", "--workers",
             str(workers), "--out", str(out / name)] + shlex.split(EXPERIMENTS[name]))


def run_all(args: argparse.Namespace) -> dict:
    names = [n for n in EXPERIMENTS if not args.only or any(o in n for o in args.only)]

    def oracle_of(name: str) -> None:
        oracle = next((o for o, src in ORACLES.items() if src == name), None)
        if oracle:
            run_oracle(args.out / name, args.out / oracle)

    return harness.run_grid(args.out, {n: command(n, args.data, args.out, args.workers)
                                       for n in names}, done=oracle_of)


def run_oracle(src: Path, dst: Path, *, data: str | None = None, device: str | None = None) -> None:
    """Post-hoc oracle calibration of ``src``'s final global model (before CCVR).

    ``data`` / ``device`` replace the run's dataset folder and device, for a run trained on
    another machine (its ``config.json`` names that machine's paths)."""
    from privfedcal.experiment import build_simulator
    from privfedcal.federation.checkpoint import load_checkpoint
    from privfedcal.settings.run_config import RunConfig, read_run_config

    raw = read_run_config(src).to_dict()
    raw.pop("calibration_params", None)  # CCVR's options; the oracle takes its own defaults
    if data:
        raw["dataset"] = f"imagefolder:{data}"
    if device:
        raw["device"] = device
    cfg = RunConfig.from_dict({**raw, "method": "fedavg", "calibrate": "oracle",
                               "out": str(dst), "workers": 1})
    sim = build_simulator(cfg, dst)
    ck = load_checkpoint(src / "checkpoint", sim.exp.device)
    sim.global_state, sim.start_round = ck["global"], cfg.training.rounds + 1
    summary = sim.finish()
    print(f"[done] {dst.name}: oracle accuracy {summary['accuracy']:.4f}", flush=True)


def table(out: Path) -> dict:
    print("| run | accuracy before calibration | accuracy | wall s |")
    print("| --- | --- | --- | --- |")
    rows = {}
    for name, s in harness.summaries(out, [*EXPERIMENTS, *ORACLES]).items():
        if s is None:
            print(f"| {name} | not run | | |")
            continue
        before = s.get("accuracy_before_calibration")
        rows[name] = {"accuracy_before_calibration": before, "accuracy": s["accuracy"],
                      "wall_seconds": s.get("wall_seconds")}
        print(f"| {name} | {'' if before is None else f'{100 * before:.2f}'} | "
              f"{100 * s['accuracy']:.2f} | {s.get('wall_seconds', 0):.0f} |")
    return rows


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--data", help="CIFAR-10 image folders (train/, test/)")
    p.add_argument("--out", type=Path, default=Path("runs-cifar"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", nargs="*", help="run only experiments whose name contains one")
    p.add_argument("--table", action="store_true", help="print the results table and exit")
    p.add_argument("--oracle", nargs=2, type=Path, metavar=("RUN", "OUT"),
                   help="only the oracle calibration of RUN's trained model, into OUT "
                        "(with --data for a run trained on another machine; on the CPU)")
    args = harness.parse(p)
    if args.table:
        harness.finish(args, {"rows": table(args.out)})
        return
    if args.oracle:
        run_oracle(*args.oracle, data=args.data, device="cpu")
        return
    if not args.data:
        sys.exit("--data is required to run experiments")
    harness.finish(args, {"runs": run_all(args)})


if __name__ == "__main__":
    main()
