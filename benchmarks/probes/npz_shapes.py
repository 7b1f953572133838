"""Why a round on a 28x28 grayscale ``.npz`` takes as long as it does: the CCVR/MOON CNN's
SGD step per image shape, and one engine round on each shape.

    python benchmarks/probes/npz_shapes.py [--threads 2] [--repeats 40] [--images 20000]

Part 1 times one SGD step (batch 64, momentum 0.9) of ``SimpleCNN`` on (channels, size) =
(1, 28), (3, 28), (1, 32), (3, 32); the shapes are interleaved and the minimum over
``--repeats`` blocks is kept, so a busy machine slows every shape alike. Part 2 runs one
round of ``privfedcal`` (10 clients, 1 local epoch, no augmentation) on random uint8 data of
each of a 28x28x1 and a 32x32x3 shape written as ``.npz`` files, and prints seconds per
round and per 1,000 images.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from privfedcal.experiment import build_simulator
from privfedcal.models.cnn import SimpleCNN
from privfedcal.settings.run_config import RunConfig

SHAPES = ((1, 28), (3, 28), (1, 32), (3, 32))


def step_times(repeats: int, batch: int = 64) -> dict[tuple[int, int], float]:
    torch.manual_seed(0)
    models = {s: SimpleCNN(num_classes=10, in_channels=s[0], image_size=s[1]) for s in SHAPES}
    opts = {s: torch.optim.SGD(models[s].parameters(), lr=0.01, momentum=0.9) for s in SHAPES}
    data = {s: (torch.randn(batch, s[0], s[1], s[1]), torch.randint(0, 10, (batch,)))
            for s in SHAPES}

    def step(s: tuple[int, int]) -> None:
        x, y = data[s]
        opts[s].zero_grad()
        F.cross_entropy(models[s](x), y).backward()
        opts[s].step()

    for s in SHAPES:  # warm-up: oneDNN picks its kernels on the first calls
        for _ in range(5):
            step(s)
    best = dict.fromkeys(SHAPES, float("inf"))
    for _ in range(repeats):
        for s in SHAPES:
            t = time.perf_counter()
            for _ in range(5):
                step(s)
            best[s] = min(best[s], (time.perf_counter() - t) / 5)
    return best


def round_time(path: Path, out: Path, threads: int) -> float:
    cfg = RunConfig.of(dataset=f"npz:{path}", rounds=1, local_epochs=1, clients=10, alpha=100.0,
                    augment=False, threads=threads, out=str(out), eval_every=1000)
    sim = build_simulator(cfg, out)
    t = time.perf_counter()
    sim.run()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--images", type=int, default=20_000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    best = step_times(args.repeats)
    for (c, size), t in best.items():
        print(f"step {c}x{size}x{size}: {t * 1e3:.2f} ms per batch of 64 "
              f"({t / 64 * 1e6:.0f} us per image)")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ((28, 28), (32, 32, 3)):
            n = args.images
            y, yt = rng.integers(0, 10, n), rng.integers(0, 10, 1000)
            x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
            xt = rng.integers(0, 256, (1000, *shape), dtype=np.uint8)
            path = Path(tmp) / f"{'x'.join(map(str, shape))}.npz"
            np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
            s = round_time(path, Path(tmp) / f"run-{path.stem}", args.threads)
            print(f"round {path.stem}: {s:.2f} s ({s / n * 1e3:.3f} s per 1,000 images)")


if __name__ == "__main__":
    main()
