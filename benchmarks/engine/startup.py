"""Start-up cost of ``privfedcal train`` on digits: everything outside ``import torch`` and the
round loop (data, model, run folder, plot, tables), and which heavy modules a command imports.

Each repeat is a fresh process (``--role phases``) that does what ``privfedcal train`` does,
phase by phase, and times each in wall and CPU seconds (``time.process_time``; a busy shared
machine inflates CPU time far less than wall time):

* ``import torch``; ``import privfedcal`` (the CLI modules ``train`` loads);
* set-up: config, run folder, ``config.json``, data, partition, model, method;
* the round loop (``Simulator.run`` less its final step), split into the first round and the
  others (a first round that imports something shows here);
* finish: the final evaluation and ``summary.json``; report: the accuracy plot and table.

Then once, the whole command under ``python -X importtime``: the cumulative import time of
the heavy packages a digits run must not load.

    python benchmarks/engine/startup.py [--rounds 20] [--repeats 5]

Prints min / median over repeats per phase, and "outside torch and the loop" = privfedcal
imports + set-up + first round's excess over a median round + finish + report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

ROOT = Path(__file__).resolve().parents[2]
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


PHASES = ("import torch", "import privfedcal", "set-up", "first round", "other rounds",
          "finish", "report", "outside torch and the loop")


def role_phases(rounds: int, out: Path) -> None:
    """One ``privfedcal train --rounds R --threads 1 --out OUT`` on digits, phase by phase."""
    clock: dict[str, tuple[float, float]] = {}
    mark = [time.perf_counter(), time.process_time()]

    def lap(name: str) -> None:
        w, c = time.perf_counter(), time.process_time()
        clock[name] = (w - mark[0], c - mark[1])
        mark[:] = [w, c]

    import torch  # noqa: F401

    lap("import torch")
    from privfedcal import experiment
    from privfedcal.cli import run_progress as cli_run
    from privfedcal.cli import train_command as cli_train
    from privfedcal.federation.simulator import Simulator

    lap("import privfedcal")
    cfg = cli_train.resolve_config(None, {"rounds": rounds, "threads": 1, "out": str(out)})
    sim = experiment.build_simulator(cfg, out)
    lap("set-up")
    finish = Simulator.finish
    times: list[tuple[float, float]] = []

    def timed_finish(self):
        lap("loop")
        result = finish(self)
        lap("finish")
        return result

    sim.finish = timed_finish.__get__(sim)  # type: ignore[method-assign]
    last = [time.perf_counter(), time.process_time()]

    def on_round(_record) -> None:
        w, c = time.perf_counter(), time.process_time()
        times.append((w - last[0], c - last[1]))
        last[:] = [w, c]

    summary = sim.run(progress=on_round)
    cli_run.report(summary, out)
    lap("report")
    loop_w, loop_c = clock.pop("loop")
    clock["first round"] = times[0]
    clock["other rounds"] = (loop_w - times[0][0], loop_c - times[0][1])
    med_w = statistics.median(t[0] for t in times[1:]) if len(times) > 1 else 0.0
    med_c = statistics.median(t[1] for t in times[1:]) if len(times) > 1 else 0.0
    outside = [clock[k] for k in ("import privfedcal", "set-up", "finish", "report")]
    clock["outside torch and the loop"] = (
        sum(o[0] for o in outside) + times[0][0] - med_w,
        sum(o[1] for o in outside) + times[0][1] - med_c)
    print("PHASES " + json.dumps(clock))


def main() -> None:
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--role", choices=["phases"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = harness.parse(ap)
    if args.role == "phases":
        return role_phases(args.rounds, args.out)
    rows: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            _, _, done = timed([sys.executable, __file__, "--role", "phases", "--rounds",
                                str(args.rounds), "--out", str(Path(tmp) / f"run{r}")])
            line = [x for x in done.stdout.splitlines() if x.startswith("PHASES ")][-1]
            for name, value in json.loads(line[len("PHASES "):]).items():
                rows.setdefault(name, []).append(tuple(value))
        _, _, done = timed(train_cmd(Path(tmp) / "imports", 2, [], True))
        imports = import_times(done.stderr)
    print(f"privfedcal train --rounds {args.rounds} --threads 1 on digits, phase by phase "
          f"({args.repeats} processes; seconds, min / median)")
    for name in PHASES:
        walls, cpus = [v[0] for v in rows[name]], [v[1] for v in rows[name]]
        print(f"  {name:>27}: wall {min(walls):6.2f} / {statistics.median(walls):6.2f}   "
              f"cpu {min(cpus):6.2f} / {statistics.median(cpus):6.2f}")
    print("  heavy imports of `privfedcal train --rounds 2` (cumulative wall s; absent = not "
          "imported): " + (", ".join(f"{k} {v:.2f}" for k, v in sorted(imports.items()))
                           or "none"))
    harness.finish(args, {"phases": {name: {"wall": harness.stats([v[0] for v in rows[name]]),
                                            "cpu": harness.stats([v[1] for v in rows[name]])}
                                     for name in PHASES},
                          "heavy_imports_s": imports})
    return None


if __name__ == "__main__":
    main()
