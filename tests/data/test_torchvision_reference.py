"""Our readers against torchvision's own code (kept apart: importing torchvision is slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from privfedcal.data import load_dataset


def test_stl10_matches_torchvision_reader(stl10_root):
    ds = load_dataset("stl10", stl10_root["root"])
    # torchvision's binary reader itself (its md5 check lives in __init__, so skip that)
    ref = torchvision.datasets.STL10.__new__(torchvision.datasets.STL10)
    ref.root, ref.base_folder = str(stl10_root["root"]), "stl10_binary"
    for split, x, y in (("train", ds.x_train, ds.y_train), ("test", ds.x_test, ds.y_test)):
        images, labels = ref._STL10__loadfile(f"{split}_X.bin", f"{split}_y.bin")
        pixels = (ds.denormalize(x) * 255).round().to(torch.int64).numpy()
        np.testing.assert_array_equal(pixels, images)
        np.testing.assert_array_equal(y.numpy(), labels)


def test_torchvision_rejects_non_release_files(cifar10_root):
    """Why we read the batches ourselves: torchvision checks every file's md5 on load."""
    import torchvision

    with pytest.raises(RuntimeError, match="corrupted"):
        torchvision.datasets.CIFAR10(str(cifar10_root["root"]), train=True, download=False)
