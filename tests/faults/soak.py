"""The long soak: run many seeded fault schedules and report every violation with the seed
and schedule that replays it.

    python -m tests.faults.soak --schedules 200 --seed 0
    python -m tests.faults.soak --replay 17          # one schedule again, with its events
    python tests/faults/soak.py --schedules 50       # also runnable as a script
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``tests.faults`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "tests.faults"

from .harness import run_schedule  # noqa: E402
from .schedule import draw  # noqa: E402


def soak(first: int, count: int, root: Path, log=print,
         minutes: float | None = None) -> tuple[int, int]:
    """Run schedules ``first .. first + count - 1`` (or as many as start within
    ``minutes``); returns (schedules run, schedules with a violation)."""
    bad, by_kind, ran = 0, Counter(), 0
    end = None if minutes is None else time.monotonic() + 60 * minutes
    for seed in range(first, first + count):
        if end is not None and time.monotonic() > end:
            break
        ran += 1
        t0 = time.perf_counter()
        out = run_schedule(draw(seed), root)
        shutil.rmtree(root / f"run-{seed}", ignore_errors=True)
        took = time.perf_counter() - t0
        if out.violations:
            bad += 1
            kinds = sorted({v.invariant for v in out.violations})
            by_kind.update(kinds)
            log(f"VIOLATION seed {seed} ({', '.join(kinds)}; {took:.1f} s): "
                f"{out.schedule.describe()}")
            for v in out.violations[:8]:
                log(f"    {v}")
        else:
            log(f"ok seed {seed} ({took:.1f} s): {'; '.join(out.events)}")
    log(f"schedules violating each invariant: {dict(sorted(by_kind.items()))}")
    return ran, bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak",
                                     description="fault-injecting soak of privfedcal runs")
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the first schedule's seed")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no schedule after this many minutes")
    parser.add_argument("--replay", type=int, default=None, help="run one seed, verbosely")
    args = parser.parse_args(argv)
    logging.getLogger("privfedcal").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay is not None:
            out = run_schedule(draw(args.replay), Path(tmp))
            print(out.schedule.describe())
            print("events:", "; ".join(out.events))
            for v in out.violations:
                print(f"  {v}")
            return 1 if out.violations else 0
        ran, bad = soak(args.seed, args.schedules, Path(tmp), minutes=args.minutes)
    print(f"schedules: {ran}, with violations: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
