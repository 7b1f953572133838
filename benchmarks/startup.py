"""Start-up cost of ``privfedcal train`` on digits: everything outside ``import torch`` and the
round loop (data, model, run folder, plot, tables), and which heavy modules a command imports.

For each repeat, three processes on the same machine:

* ``python -c "import torch"``: the interpreter plus torch, the floor of any PyTorch script;
* ``privfedcal train --rounds R --threads 1`` (a fresh run folder), timed as a whole; its
  round loop is the sum of the rounds' own ``seconds`` in ``metrics.jsonl``;
* the same command under ``python -X importtime``: the cumulative import time of the heavy
  packages the command must not load unless it uses them.

    python benchmarks/startup.py [--rounds 20] [--repeats 5] [-- extra train flags]

Prints, min and median over repeats: the whole process, ``import torch``, the round loop and
the rest (whole - import torch - round loop: the start-up and reporting this benchmark
bounds), then the import times (last repeat) of torch._dynamo, torchvision, sklearn,
opacus, tenseal, matplotlib, scipy.
"""

from __future__ import annotations

import argparse
import json
import os
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


def timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), **kw)
    dt = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dt, done


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
    rows: dict[str, list[float]] = {"whole": [], "import torch": [], "round loop": [],
                                    "rest": []}
    imports: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            t_torch, _ = timed([sys.executable, "-c", "import torch"])
            run = Path(tmp) / f"run{r}"
            t_whole, _ = timed(train_cmd(run, args.rounds, args.extra))
            loop = sum(json.loads(line)["seconds"]
                       for line in (run / "metrics.jsonl").read_text().splitlines() if line)
            rows["whole"].append(t_whole)
            rows["import torch"].append(t_torch)
            rows["round loop"].append(loop)
            rows["rest"].append(t_whole - t_torch - loop)
        _, done = timed(train_cmd(Path(tmp) / "imports", args.rounds, args.extra, True))
        imports = import_times(done.stderr)
    print(f"privfedcal train --rounds {args.rounds} --threads 1 {' '.join(args.extra)}"
          f"({args.repeats} repeats)")
    for name, values in rows.items():
        print(f"  {name:>12}: min {min(values):6.2f} s   median {statistics.median(values):6.2f} s")
    print("  heavy imports (cumulative s; absent = not imported): "
          + (", ".join(f"{k} {v:.2f}" for k, v in sorted(imports.items())) or "none"))


if __name__ == "__main__":
    main()
