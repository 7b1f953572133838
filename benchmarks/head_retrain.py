"""Head re-training speed: closed-form softmax-CE SGD against the autograd path.

    python benchmarks/head_retrain.py [--repeats 3]

CReFF's authors' recipe on CIFAR-10 sizes: 1,000 federated features of d = 256, 10 classes,
300 epochs of batch-32 minibatches (9,600 SGD steps), lr 0.01, one thread. Prints min/median
seconds per re-training and the ratio; the two paths give the same head (tests/calibration).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from privfedcal.calibration.retrain import fresh_head, retrain_classifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1000, 256, generator=g)
    labels = torch.arange(10).repeat_interleave(100)
    w, b = fresh_head(10, 256, g)
    times: dict[str, list[float]] = {"closed form": [], "autograd": []}
    for _ in range(args.repeats):
        for name, closed in (("closed form", True), ("autograd", False)):
            t = time.perf_counter()
            retrain_classifier(w, b, feats, labels, steps=9600, lr=0.01, batch_size=32,
                               generator=torch.Generator().manual_seed(1), closed_form=closed)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name:12s} min {min(ts):6.2f} s  median {statistics.median(ts):6.2f} s")
    ratio = statistics.median(times["autograd"]) / statistics.median(times["closed form"])
    print(f"closed form is {ratio:.2f}x faster (median)")


if __name__ == "__main__":
    main()
