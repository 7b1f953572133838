"""Start-up cost of ``privfedcal train`` on digits: everything outside ``import torch`` and the
round loop (data, model, run folder, plot, tables), and which heavy modules a command imports.

For each repeat, processes on the same machine, each timed in wall and CPU seconds
(user + system of the child, which a busy shared machine inflates far less than wall time):

* ``python -c "import torch"``: the interpreter plus torch, the floor of any PyTorch script;
* ``privfedcal train --rounds R --threads 1`` and the same with ``--rounds 2`` (fresh run
  folders): the round loop costs (T_R - T_2) / (R - 2) per round, so the fixed part is
  T_2 - 2 x per-round - T_torch: data, model, run folder, checkpoints' first write, plot,
  tables and every import beyond torch;
* once, the R-round command under ``python -X importtime``: the cumulative import time of
  the heavy packages the command must not load unless it uses them.

    python benchmarks/startup.py [--rounds 20] [--repeats 5] [-- extra train flags]

Prints min and median over repeats of each measured process and of the fixed part.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "torchvision", "sklearn", "opacus", "tenseal", "matplotlib", "scipy",
         "torchmetrics", "flwr")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    return e


def timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, CPU seconds of the child, the completed process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env())
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dt, cpu, done


def import_times(stderr: str) -> dict[str, float]:
    """Cumulative seconds of every top-level import of the HEAVY packages."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cum, name = line.split("|")
        name = name.strip()
        if name in HEAVY and cum.strip().isdigit():
            out[name] = out.get(name, 0.0) + int(cum) / 1e6
    return out


def train_cmd(out: Path, rounds: int, extra: list[str], importtime: bool = False) -> list[str]:
    flags = ["-X", "importtime"] if importtime else []
    return [sys.executable, *flags, "-m", "privfedcal.cli.main", "train", "--rounds",
            str(rounds), "--threads", "1", "--out", str(out), *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="more `privfedcal train` flags (after --)")
    args = ap.parse_args()
    if args.rounds <= 2:
        ap.error("--rounds must be > 2")
    rows: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, wall: float, cpu: float) -> None:
        rows.setdefault(name, []).append((wall, cpu))

    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            w_t, c_t, _ = timed([sys.executable, "-c", "import torch"])
            w_2, c_2, _ = timed(train_cmd(Path(tmp) / f"two{r}", 2, args.extra))
            w_r, c_r, _ = timed(train_cmd(Path(tmp) / f"run{r}", args.rounds, args.extra))
            per_w, per_c = (w_r - w_2) / (args.rounds - 2), (c_r - c_2) / (args.rounds - 2)
            add("import torch", w_t, c_t)
            add(f"train, {args.rounds} rounds", w_r, c_r)
            add("train, 2 rounds", w_2, c_2)
            add("one round", per_w, per_c)
            add("fixed part", w_2 - 2 * per_w - w_t, c_2 - 2 * per_c - c_t)
        _, _, done = timed(train_cmd(Path(tmp) / "imports", args.rounds, args.extra, True))
        imports = import_times(done.stderr)
    print(f"privfedcal train --threads 1 {' '.join(args.extra)} ({args.repeats} repeats; "
          "seconds, min / median)")
    for name, values in rows.items():
        walls, cpus = [v[0] for v in values], [v[1] for v in values]
        print(f"  {name:>22}: wall {min(walls):6.2f} / {statistics.median(walls):6.2f}   "
              f"cpu {min(cpus):6.2f} / {statistics.median(cpus):6.2f}")
    print("  heavy imports (cumulative s; absent = not imported): "
          + (", ".join(f"{k} {v:.2f}" for k, v in sorted(imports.items())) or "none"))


if __name__ == "__main__":
    main()
