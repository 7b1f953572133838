"""The default experiment on a quiet and on a busy machine: the default thread choice against
``--threads 1`` (and ``--threads`` = the core count), whole processes.

A busy machine is made by the benchmark itself: ``--busy N`` CPU-bound Python processes
(default: one per core) that spin for at most the benchmark's own duration and are killed
when it ends, so nothing outlives it. Each condition runs every setting interleaved
(``privfedcal train --rounds R --out DIR`` with the setting's ``--threads``, or none for the
default), and prints min / median wall seconds per setting and the ratios the scale issue
asks about: default / ``--threads 1`` under load (target <= 1.5) and busy / quiet.

    python benchmarks/engine/busy_machine.py [--rounds 20] [--repeats 3] [--busy N]
        [--model mlp] [--dataset digits] [--device cpu]

With ``--device cuda`` the same conditions show what the thread choice does to the GPU path
(the host threads only feed the GPU there).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

SPIN = "import time\nend = time.time() + {limit}\nwhile time.time() < end:\n    pass\n"


def start_busy(n: int, limit: float) -> list[subprocess.Popen]:
    """``n`` processes spinning on one core each for at most ``limit`` seconds."""
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(limit=limit)])
            for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_once(threads: int | None, args, out: Path) -> float:
    cmd = [sys.executable, "-m", "privfedcal.cli.main", "train", "--rounds", str(args.rounds),
           "--model", args.model, "--dataset", args.dataset, "--device", args.device,
           "--out", str(out)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2,
                    help="competing CPU-bound processes in the busy condition")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda to show that the thread choice leaves the GPU path alone")
    ap.add_argument("--limit", type=float, default=1800.0,
                    help="seconds after which a busy process stops by itself")
    args = harness.parse(ap)
    cores = os.cpu_count() or 2
    settings: dict[str, int | None] = {"default": None, "--threads 1": 1,
                                       f"--threads {cores}": cores}
    times: dict[tuple[str, str], list[float]] = {}
    loads: dict[str, tuple[float, ...]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for condition in ("quiet", "busy"):
            procs = start_busy(args.busy, args.limit) if condition == "busy" else []
            try:
                for r in range(args.repeats):
                    for name, threads in settings.items():
                        out = Path(tmp) / f"{condition}-{name.replace(' ', '')}-{r}"
                        times.setdefault((condition, name), []).append(
                            run_once(threads, args, out))
                loads[condition] = os.getloadavg()
            finally:
                stop(procs)
    print(f"privfedcal train --rounds {args.rounds} --model {args.model} --dataset "
          f"{args.dataset} --device {args.device}: whole process, {args.repeats} repeats interleaved, {cores} CPUs; "
          f"busy = {args.busy} spinning processes")
    for condition in ("quiet", "busy"):
        print(f"{condition} (load average at the end {', '.join(f'{v:.1f}' for v in loads[condition])})")
        for name in settings:
            t = times[(condition, name)]
            print(f"  {name:>12}: min {min(t):7.2f} s   median {statistics.median(t):7.2f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"busy: default / --threads 1 = {med[('busy', 'default')] / med[('busy', '--threads 1')]:.2f}"
          " (target <= 1.5)")
    print(f"quiet: default / --threads 1 = {med[('quiet', 'default')] / med[('quiet', '--threads 1')]:.2f}")
    print(f"default: busy / quiet = {med[('busy', 'default')] / med[('quiet', 'default')]:.2f}")
    harness.finish(args, {f"{c} {n}": harness.stats(t) for (c, n), t in times.items()})


if __name__ == "__main__":
    main()
