"""Tiny fake datasets in every on-disk format the loaders read (written fresh per test)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                 "ship", "truck"]


def _dump(path: Path, obj: object) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh)


@pytest.fixture
def cifar10_root(tmp_path: Path) -> dict:
    """``cifar-10-batches-py`` with 5 train batches of 4 images and a test batch of 6."""
    rng = np.random.default_rng(1)
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    train_x, train_y = [], []
    for i in range(1, 6):
        x = rng.integers(0, 256, size=(4, 3072), dtype=np.uint8)
        y = rng.integers(0, 10, size=4).tolist()
        _dump(base / f"data_batch_{i}", {"batch_label": f"training batch {i} of 5",
                                          "labels": y, "data": x,
                                          "filenames": [f"img{j}.png" for j in range(4)]})
        train_x.append(x)
        train_y += y
    test_x = rng.integers(0, 256, size=(6, 3072), dtype=np.uint8)
    test_x[0] = 0
    test_x[0, :1024] = 255  # first test image: pure red (CIFAR rows are R plane, G, B)
    test_y = rng.integers(0, 10, size=6).tolist()
    _dump(base / "test_batch", {"labels": test_y, "data": test_x})
    _dump(base / "batches.meta", {"label_names": CIFAR10_NAMES, "num_vis": 3072})
    return {"root": tmp_path, "x_train": np.concatenate(train_x), "y_train": np.array(train_y),
            "x_test": test_x, "y_test": np.array(test_y)}


@pytest.fixture
def cifar100_root(tmp_path: Path) -> dict:
    """``cifar-100-python`` with ``train`` (7 images), ``test`` (3) and ``meta``."""
    rng = np.random.default_rng(2)
    base = tmp_path / "cifar-100-python"
    base.mkdir()
    out = {"root": tmp_path}
    for split, n in (("train", 7), ("test", 3)):
        x = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        fine = rng.integers(0, 100, size=n).tolist()
        _dump(base / split, {"data": x, "fine_labels": fine,
                             "coarse_labels": [f // 5 for f in fine]})
        out[f"x_{split}"], out[f"y_{split}"] = x, np.array(fine)
    _dump(base / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)],
                          "coarse_label_names": [f"coarse{i}" for i in range(20)]})
    return out


@pytest.fixture
def stl10_root(tmp_path: Path) -> dict:
    """``stl10_binary``: images written column-major, labels 1..10, as the release does."""
    rng = np.random.default_rng(3)
    base = tmp_path / "stl10_binary"
    base.mkdir()
    out = {"root": tmp_path}
    for split, n in (("train", 3), ("test", 2)):
        x = rng.integers(0, 256, size=(n, 3, 96, 96), dtype=np.uint8)  # (N, C, H, W)
        y = rng.integers(1, 11, size=n).astype(np.uint8)
        (base / f"{split}_X.bin").write_bytes(x.transpose(0, 1, 3, 2).tobytes())
        (base / f"{split}_y.bin").write_bytes(y.tobytes())
        out[f"x_{split}"], out[f"y_{split}"] = x, y.astype(np.int64) - 1
    return out


def write_png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


@pytest.fixture
def imagefolder_root(tmp_path: Path) -> dict:
    """``train/`` and ``test/`` with classes ``cat``, ``dog`` (6x5 RGB PNGs) and a ``valid/``."""
    rng = np.random.default_rng(4)
    root = tmp_path / "folder"
    out: dict = {"root": root}
    for split, per_class in (("train", 3), ("test", 2), ("valid", 1)):
        xs, ys = [], []
        for label, cls in enumerate(["cat", "dog"]):
            for i in range(per_class):
                px = rng.integers(0, 256, size=(5, 6, 3), dtype=np.uint8)  # H=5, W=6
                write_png(root / split / cls / f"{i:02d}.png", px)
                xs.append(px.transpose(2, 0, 1))
                ys.append(label)
        out[f"x_{split}"], out[f"y_{split}"] = np.stack(xs), np.array(ys)
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    return out


@pytest.fixture
def domains_root(tmp_path: Path) -> Path:
    """``<domain>/<class>/`` folders: art has 10 images, photo 5 (4x4 RGB PNGs)."""
    rng = np.random.default_rng(5)
    root = tmp_path / "pacs"
    for domain, per_class in (("art", 5), ("photo", 3)):
        for cls in ("dog", "elephant") if domain == "art" else ("dog", "guitar"):
            n = per_class if domain == "art" else (3 if cls == "dog" else 2)
            for i in range(n):
                write_png(root / domain / cls / f"{i}.png",
                          rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8))
    return root
