"""CIFAR-shaped random data for the benchmarks: an ``npz:`` file privfedcal reads as is."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_npz(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` random 32x32x3 uint8 images with 10 classes (the first 1,000 double as test set)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, size=n)
    np.savez(path, x_train=x, y_train=y, x_test=x[:1000], y_test=y[:1000])
    return path
