"""Time ``load_dataset("imagefolder:PATH")`` with the decoded-pixel cache cold, warm and off.

    python benchmarks/engine/imagefolder_load.py /work/data/cifar10 [--repeats 3]

Each measurement runs in a fresh process (so nothing is reused in memory); the cache lives in
a temporary folder that is removed afterwards. Prints min / median seconds per setting.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

_CHILD = ("import time, sys; from privfedcal.data import load_dataset; t = time.perf_counter(); "
          "load_dataset('imagefolder:' + sys.argv[1]); print(time.perf_counter() - t)")


def _time(path: str, cache: str) -> float:
    env = dict(os.environ, PRIVFEDCAL_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", _CHILD, path], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("path")
    args = harness.parse(ap)
    with tempfile.TemporaryDirectory() as cache:
        rows = {"cache off (decode every image)": [_time(args.path, "off") for _ in range(args.repeats)],
                "cold (decode + write cache)": [_time(args.path, cache)]}
        rows["warm (read cache)"] = [_time(args.path, cache) for _ in range(args.repeats)]
    for name, ts in rows.items():
        print(f"{name:34s} min {min(ts):6.2f} s  median {statistics.median(ts):6.2f} s  (n={len(ts)})")
    off, warm = statistics.median(rows["cache off (decode every image)"]), statistics.median(rows["warm (read cache)"])
    print(f"speed-up of a warm cache over decoding: {off / warm:.1f}x")
    harness.finish(args, {name: {"seconds": ts, **harness.stats(ts)} for name, ts in rows.items()})


if __name__ == "__main__":
    main()
