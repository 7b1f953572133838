"""Head re-training speed: closed-form softmax-CE SGD against the autograd path.

    python benchmarks/calibration/head_retrain.py [--repeats 3] [--paths "closed form,autograd"]

CReFF's authors' recipe on CIFAR-10 sizes: 1,000 federated features of d = 256, 10 classes,
300 epochs of batch-32 minibatches (9,600 SGD steps), lr 0.01, one thread. Prints min/median
wall and CPU seconds per re-training, the ratio, and the load average; the two paths give the
same head up to float rounding (tests/calibration).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.calibration.retrain import fresh_head, retrain_classifier


def main() -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--paths", default="closed form,autograd")
    args = harness.parse(ap)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1000, 256, generator=g)
    labels = torch.arange(10).repeat_interleave(100)
    w, b = fresh_head(10, 256, g)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
    for _ in range(args.repeats):
        for name in paths:
            t, c = time.perf_counter(), time.process_time()
            retrain_classifier(w, b, feats, labels, steps=9600, lr=0.01, batch_size=32,
                               generator=torch.Generator().manual_seed(1),
                               closed_form=name == "closed form")
            times[name].append((time.perf_counter() - t, time.process_time() - c))
    for name, ts in times.items():
        wall, cpu = [t[0] for t in ts], [t[1] for t in ts]
        print(f"{name:12s} wall min {min(wall):6.2f} s  median {statistics.median(wall):6.2f} s"
              f"   CPU min {min(cpu):6.2f} s  median {statistics.median(cpu):6.2f} s")
    if len(paths) == 2:
        ratio = (statistics.median(t[0] for t in times["autograd"])
                 / statistics.median(t[0] for t in times["closed form"]))
        print(f"closed form is {ratio:.2f}x faster (median wall)")
    harness.finish(args, {name: {"wall": harness.stats([t[0] for t in ts]),
                                 "cpu": harness.stats([t[1] for t in ts])}
                          for name, ts in times.items()})


if __name__ == "__main__":
    main()
