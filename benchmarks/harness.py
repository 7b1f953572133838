"""What the results-generating benchmarks share: their flags, repeats and min / median, the
machine and load a measurement ran on, and ``--json PATH`` with the numbers it printed.

A script under ``benchmarks/<area>/`` puts ``benchmarks/`` on ``sys.path`` and uses it so::

    ap = harness.parser(__doc__, repeats=5, threads=2)   # adds --repeats, --threads, --json
    ap.add_argument("--images", type=int, default=10_000)
    args = harness.parse(ap)                             # notes the load average before
    times = harness.repeat(lambda: work(args), args.repeats, warmup=1)
    print("work", harness.min_median(times))
    harness.finish(args, {"work": harness.stats(times)})  # machine line; JSON if --json

The machine line (CPU count, load average before and after, torch version, device) goes with
every number because the machines these run on are shared: a measurement taken under load
reads differently, and the line says how busy the machine was.

The launchers of long runs (``accuracy/``) share ``run_grid`` (named ``privfedcal train``
commands, each logged beside its run folder, a finished run skipped so that a grid can be
re-started) and ``summaries`` (each run's ``summary.json``, for the tables they print).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

_load_before: tuple[float, float, float] | None = None


def parser(doc: str | None, *, repeats: int | None = None,
           threads: int | None = None) -> argparse.ArgumentParser:
    """A parser whose help is the script's docstring, with ``--json PATH`` and, where a
    default is given, ``--repeats N`` and ``--threads N``."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed repeats per setting (default {repeats})")
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads,
                        help=f"torch threads (default {threads})")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH",
                    help="also write the arguments, the machine and the results as JSON")
    return ap


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the flags and note the load average before the measurement."""
    global _load_before
    args = ap.parse_args(argv)
    _load_before = os.getloadavg()
    return args


def repeat(fn: Callable[[], Any], repeats: int, *, warmup: int = 0) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def stats(values: Sequence[float]) -> dict[str, float]:
    """Min, median and count: the minimum is the usual estimate on a shared machine (other
    work only ever adds time), the median says how steady the repeats were."""
    if not values:
        raise ValueError("no values")
    return {"min": min(values), "median": statistics.median(values), "n": len(values)}


def min_median(values: Sequence[float], unit: str = "s", digits: int = 3) -> str:
    """``min 1.234 s  median 1.300 s  (n=3)``."""
    s = stats(values)
    return (f"min {s['min']:.{digits}f} {unit}  median {s['median']:.{digits}f} {unit}"
            f"  (n={s['n']})")


def device() -> str:
    """The accelerator torch sees, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def machine() -> dict[str, Any]:
    """CPU count, load average before (at ``parse``) and now, torch version, device."""
    import torch

    return {"cpus": os.cpu_count(), "load_before": _load_before,
            "load_after": os.getloadavg(), "torch": torch.__version__, "device": device(),
            "python": platform.python_version(), "platform": platform.platform()}


def machine_line(m: dict[str, Any]) -> str:
    """One line saying what the numbers above it ran on."""
    def load(v: Sequence[float] | None) -> str:
        return "?" if v is None else ", ".join(f"{x:.2f}" for x in v)

    return (f"machine: {m['cpus']} CPUs, load average (1, 5, 15 min) before {load(m['load_before'])}"
            f" / after {load(m['load_after'])}, torch {m['torch']}, device {m['device']}")


def _plain(value: Any) -> Any:
    """JSON-ready: paths as strings, tuples as lists, anything else unknown as its repr."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return repr(value)


def finish(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """Print the machine line and, with ``--json PATH``, write the benchmark's name, its
    arguments, the machine and ``results`` there. Returns what it wrote."""
    m = machine()
    print(machine_line(m))
    record = {"benchmark": Path(sys.argv[0]).stem,
              "args": {k: v for k, v in vars(args).items() if k != "json"},
              "machine": m, "results": results}
    record = _plain(record)
    if getattr(args, "json", None) is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return record


def run_grid(out: Path, commands: dict[str, list[str]],
             done: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Run each named command, one after another, unless its run folder ``out/NAME``
    already holds a ``summary.json`` (a finished run: skipped); its output goes to
    ``out/NAME.log``, and ``done(NAME)`` follows each command that exited 0. Prints what
    runs, what is skipped and how each ended; returns NAME -> ``{"exit", "seconds"}`` or
    ``{"skipped": True}``."""
    out.mkdir(parents=True, exist_ok=True)
    status: dict[str, dict[str, Any]] = {}
    for name, cmd in commands.items():
        if (out / name / "summary.json").exists():
            print(f"[skip] {name}: done", flush=True)
            status[name] = {"skipped": True}
            continue
        print(f"[run] {name}: {shlex.join(cmd)}", flush=True)
        t0 = time.time()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        seconds = time.time() - t0
        print(f"[done] {name}: exit {rc} after {seconds:.0f} s", flush=True)
        status[name] = {"exit": rc, "seconds": round(seconds, 1)}
        if rc == 0 and done is not None:
            done(name)
    return status


def summaries(out: Path, names: Iterable[str]) -> dict[str, dict[str, Any] | None]:
    """Each named run's ``summary.json`` under ``out`` (None where it has not finished)."""
    found: dict[str, dict[str, Any] | None] = {}
    for name in names:
        f = out / name / "summary.json"
        found[name] = json.loads(f.read_text()) if f.exists() else None
    return found
