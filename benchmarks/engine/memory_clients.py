"""Peak memory against the number of clients on the same data: 10 vs 100 clients.

Each configuration runs ``privfedcal train`` in a fresh process (FedAvg, IID partition, full
participation, 1 local epoch, CPU, one thread, no transcript); the peak resident set size
of that process (``ru_maxrss`` of the child) is compared between 10 and 100 clients. The
data are the same, so only per-client structures can make the difference: client index
tensors, per-round model copies, per-client method state.

    python benchmarks/engine/memory_clients.py [--rounds 2] [--images 5000] [--method fedavg]
        [--repeats 1]

Workloads: digits (MLP) and ``--images`` random CIFAR-shaped images (the CCVR/MOON CNN).
Prints peak MiB per client count (min / median over repeats) and the ratio 100 / 10
(target <= 1.2).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cifar_like, harness
import harness

ROOT = Path(__file__).resolve().parents[2]


def peak_mib(cmd: list[str]) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    code = ("import resource, runpy, sys\n"
            "sys.argv = ['privfedcal'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('privfedcal.cli.main', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    done = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("PEAK_KIB")][-1]
    return int(line.split()[1]) / 1024


def main() -> None:
    ap = harness.parser(__doc__, repeats=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--method", default="fedavg")
    args = harness.parse(ap)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        from cifar_like import make_npz

        npz = make_npz(tmp_path / "cifar-shaped.npz", args.images)
        workloads = {"digits, MLP": ["--dataset", "digits"],
                     f"{args.images} CIFAR-shaped images, CNN": [
                         "--dataset", f"npz:{npz}", "--model", "cnn", "--no-augment"]}
        print(f"{args.method}, IID, {args.rounds} rounds, 1 local epoch, 1 thread, "
              f"{args.repeats} repeat(s): peak RSS of the whole process")
        for name, flags in workloads.items():
            peaks: dict[int, list[float]] = {}
            for k in (10, 100):
                for r in range(args.repeats):
                    cmd = ["train", "--method", args.method, "--clients", str(k),
                           "--partition", "iid", "--rounds", str(args.rounds),
                           "--local-epochs", "1", "--threads", "1", "--device", "cpu",
                           "--no-transcript", "--out", str(tmp_path / f"{k}-{r}-{len(name)}"),
                           *flags]
                    peaks.setdefault(k, []).append(peak_mib(cmd))
            med = {k: statistics.median(v) for k, v in peaks.items()}
            print(f"  {name}: 10 clients {min(peaks[10]):.0f} / {med[10]:.0f} MiB, "
                  f"100 clients {min(peaks[100]):.0f} / {med[100]:.0f} MiB, "
                  f"ratio 100/10 {med[100] / med[10]:.3f} (target <= 1.2)")
            results[name] = {f"{k} clients": {"peak_mib": v, **harness.stats(v)}
                             for k, v in peaks.items()}
    harness.finish(args, results)


if __name__ == "__main__":
    main()
