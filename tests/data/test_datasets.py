"""Loaders: pixels, labels, layouts and normalisation checked against the files written."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from privfedcal.data import Dataset, default_model_for, load_dataset
from privfedcal.errors import UsageError


def write_png(path, pixels: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def pixels_255(ds: Dataset, x: torch.Tensor) -> np.ndarray:
    return (ds.denormalize(x) * 255).round().to(torch.int64).numpy()


def check_stats(ds: Dataset) -> None:
    """mean/std are the training split's per-channel moments (numpy, float64)."""
    raw = ds.denormalize(ds.x_train).double().numpy()
    np.testing.assert_allclose(ds.mean, raw.mean(axis=(0, 2, 3)), atol=1e-5)
    np.testing.assert_allclose(ds.std, raw.std(axis=(0, 2, 3)), rtol=1e-4)
    normalised = ds.x_train.double().numpy()
    np.testing.assert_allclose(normalised.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64


def test_digits_split_is_fixed_and_stratified():
    ds = load_dataset("digits")
    assert (ds.name, ds.num_classes, ds.in_channels, ds.image_size, ds.augment) == ("digits", 10, 1, 8, False)
    bunch = load_digits()
    n_class = np.bincount(bunch.target)
    expected_test = np.floor(0.25 * n_class + 0.5).astype(int)  # round(n_c / 4) per class
    np.testing.assert_array_equal(np.bincount(ds.y_test.numpy(), minlength=10), expected_test)
    assert ds.num_train + len(ds.y_test) == len(bunch.target) == 1797
    raw_train = (ds.denormalize(ds.x_train) * 16).round().numpy().astype(int)
    raw_test = (ds.denormalize(ds.x_test) * 16).round().numpy().astype(int)
    assert raw_train.sum() + raw_test.sum() == bunch.images.astype(int).sum()
    # Golden fingerprint of the fixed split (seed 0): it must never change between versions.
    assert int(raw_test.sum()) == 140339
    assert ds.y_test[:12].tolist() == [1, 5, 9, 2, 4, 5, 6, 7, 9, 3, 4, 6]
    check_stats(ds)


def test_cifar10_reader_matches_files(cifar10_root):
    ds = load_dataset("cifar10", cifar10_root["root"])
    assert ds.classes[0] == "airplane" and ds.num_classes == 10 and ds.augment
    assert tuple(ds.x_train.shape) == (20, 3, 32, 32) and tuple(ds.x_test.shape) == (6, 3, 32, 32)
    np.testing.assert_array_equal(pixels_255(ds, ds.x_train),
                                  cifar10_root["x_train"].reshape(-1, 3, 32, 32))
    np.testing.assert_array_equal(ds.y_train.numpy(), cifar10_root["y_train"])
    np.testing.assert_array_equal(ds.y_test.numpy(), cifar10_root["y_test"])
    red = pixels_255(ds, ds.x_test[:1])[0]
    assert (red[0] == 255).all() and (red[1:] == 0).all()  # R plane first
    check_stats(ds)


def test_cifar100_fine_labels(cifar100_root):
    ds = load_dataset("cifar100", str(cifar100_root["root"]))
    assert ds.num_classes == 100 and ds.classes[7] == "fine7"
    np.testing.assert_array_equal(ds.y_train.numpy(), cifar100_root["y_train"])
    np.testing.assert_array_equal(pixels_255(ds, ds.x_test), cifar100_root["x_test"].reshape(-1, 3, 32, 32))


def test_stl10_column_major_binary(stl10_root):
    ds = load_dataset("stl10", stl10_root["root"])
    assert ds.image_size == 96 and ds.classes[0] == "airplane" and ds.num_classes == 10
    np.testing.assert_array_equal(pixels_255(ds, ds.x_train), stl10_root["x_train"])
    np.testing.assert_array_equal(ds.y_train.numpy(), stl10_root["y_train"])
    np.testing.assert_array_equal(ds.y_test.numpy(), stl10_root["y_test"])


def test_stl10_class_names_file(stl10_root):
    names = [f"c{i}" for i in range(10)]
    (stl10_root["root"] / "stl10_binary" / "class_names.txt").write_text("\n".join(names) + "\n")
    assert load_dataset("stl10", stl10_root["root"]).classes == names


def test_imagefolder_train_test(imagefolder_root):
    ds = load_dataset(f"imagefolder:{imagefolder_root['root']}")
    assert ds.classes == ["cat", "dog"] and ds.augment and ds.domains_train is None
    assert (ds.in_channels, ds.image_size, ds.x_train.shape[-1]) == (3, 5, 6)
    np.testing.assert_array_equal(pixels_255(ds, ds.x_train), imagefolder_root["x_train"])
    np.testing.assert_array_equal(ds.y_test.numpy(), imagefolder_root["y_test"])
    assert len(ds.y_train) == 6 and len(ds.y_test) == 4  # valid/ ignored, notes.txt skipped
    check_stats(ds)


def test_imagefolder_errors(imagefolder_root, tmp_path):
    root = imagefolder_root["root"]
    write_png(root / "test" / "bird" / "0.png", np.zeros((5, 6, 3), np.uint8))
    with pytest.raises(UsageError, match="bird"):
        load_dataset(f"imagefolder:{root}")
    (root / "test" / "bird" / "0.png").unlink()
    (root / "test" / "bird").rmdir()
    write_png(root / "train" / "dog" / "big.png", np.zeros((7, 6, 3), np.uint8))
    with pytest.raises(UsageError, match="differ in size"):
        load_dataset(f"imagefolder:{root}")
    with pytest.raises(UsageError, match="not a directory"):
        load_dataset(f"imagefolder:{tmp_path / 'absent'}")
    (tmp_path / "flat").mkdir()
    write_png(tmp_path / "flat" / "x" / "0.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(UsageError, match="<domain>/<class>"):
        load_dataset(f"imagefolder:{tmp_path / 'flat'}")


def test_domain_folders(domains_root):
    ds = load_dataset(f"imagefolder:{domains_root}")
    assert ds.domain_names == ["art", "photo"] and ds.classes == ["dog", "elephant", "guitar"]
    dom_train, dom_test = ds.domains_train.tolist(), ds.domains_test.tolist()
    # art: 10 images -> 2 test; photo: 5 images -> round(1.0) = 1 test
    assert (dom_test.count(0), dom_test.count(1)) == (2, 1)
    assert (dom_train.count(0), dom_train.count(1)) == (8, 4)
    art_labels = ds.y_train[ds.domains_train == 0].tolist() + ds.y_test[ds.domains_test == 0].tolist()
    assert sorted(art_labels) == [0] * 5 + [1] * 5  # art holds dog and elephant only
    again = load_dataset(f"imagefolder:{domains_root}")
    assert torch.equal(again.x_test, ds.x_test) and torch.equal(again.y_train, ds.y_train)


def test_npz_layouts(tmp_path):
    rng = np.random.default_rng(6)
    nchw = rng.integers(0, 256, size=(5, 3, 4, 4), dtype=np.uint8)
    cases = {
        "hw": (nchw[:, 0], nchw[:, :1]),  # (N, H, W) -> one channel
        "hwc": (nchw.transpose(0, 2, 3, 1), nchw),  # (N, H, W, C)
        "chw": (nchw, nchw),
        "float": (nchw.astype(np.float32) / 255, nchw),
    }
    y = np.array([0, 1, 2, 1, 0])
    for name, (x, expected) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])
        ds = load_dataset(f"npz:{path}")
        np.testing.assert_array_equal(pixels_255(ds, ds.x_train), expected, err_msg=name)
        assert ds.classes == ["0", "1", "2"] and ds.augment == (expected.shape[1] == 3)
    named = tmp_path / "named.npz"
    np.savez(named, x_train=nchw, y_train=y, x_test=nchw, y_test=y, classes=np.array(["a", "b", "c", "d"]))
    assert load_dataset(f"npz:{named}").classes == ["a", "b", "c", "d"]


@pytest.mark.parametrize("arrays, match", [
    ({"x_train": np.zeros((2, 4, 4), np.uint8), "y_train": np.zeros(2, int)}, "lacks"),
    ({"y_train": np.zeros(3, int)}, "one per image"),
    ({"x_train": np.full((2, 4, 4), 2.0)}, r"\[0, 1\]"),
    ({"x_train": np.zeros((2, 5, 4, 4), np.uint8)}, "channel axis"),
    ({"x_test": np.zeros((1, 5, 5), np.uint8)}, "differ in image shape"),
    ({"y_train": np.array([0.0, 1.0])}, "integers"),
])
def test_npz_errors(tmp_path, arrays, match):
    base = {"x_train": np.zeros((2, 4, 4), np.uint8), "y_train": np.array([0, 1]),
            "x_test": np.zeros((1, 4, 4), np.uint8), "y_test": np.array([1])}
    if match == "lacks":
        base = arrays
    else:
        base.update(arrays)
    np.savez(tmp_path / "d.npz", **base)
    with pytest.raises(UsageError, match=match):
        load_dataset(f"npz:{tmp_path / 'd.npz'}")


def test_missing_data_and_bad_names(tmp_path):
    with pytest.raises(UsageError, match="digits, cifar10, cifar100, stl10, imagefolder:PATH, npz:PATH"):
        load_dataset("mnist")
    with pytest.raises(UsageError, match="--data-root"):
        load_dataset("cifar10")
    for name, folder in (("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"),
                         ("stl10", "stl10_binary")):
        with pytest.raises(UsageError, match="--download") as info:
            load_dataset(name, tmp_path)
        assert str(tmp_path / folder) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="needs a path"):
        load_dataset("npz")
    with pytest.raises(UsageError, match="takes no"):
        load_dataset("digits:/tmp")


def test_pickles_with_code_are_refused(cifar10_root):
    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = cifar10_root["root"] / "cifar-10-batches-py" / "test_batch"
    with open(path, "wb") as fh:
        import pickle

        pickle.dump({"data": Evil(), "labels": []}, fh)
    with pytest.raises(UsageError, match="refusing to load"):
        load_dataset("cifar10", cifar10_root["root"])


def test_download_failure_is_one_line(tmp_path):
    from privfedcal.data.datasets import _fetch

    def offline():
        raise OSError("[Errno -3] Temporary failure in name resolution\nmore")

    with pytest.raises(UsageError, match="could not download cifar10") as info:
        _fetch("cifar10", tmp_path, offline)
    assert "\n" not in str(info.value)


def test_to_denormalize_and_default_model():
    ds = load_dataset("digits")
    moved = ds.to("cpu")
    assert moved is not ds and torch.equal(moved.x_train, ds.x_train)
    assert ds.denormalize(ds.x_train).min() >= -1e-6 and ds.denormalize(ds.x_train).max() <= 1 + 1e-6
    assert default_model_for("digits") == "mlp" and default_model_for(ds) == "mlp"
    assert default_model_for("cifar10") == default_model_for("stl10") == "cnn"
    assert default_model_for("npz:/x.npz", image_size=8) == "mlp"
    assert default_model_for("imagefolder:/x", image_size=32) == "cnn"
    with pytest.raises(UsageError):
        default_model_for("mnist")
    assert "digits" in repr(ds) and "1346" in repr(ds)


def test_imagefolder_cache(imagefolder_root, tmp_path, monkeypatch):
    from privfedcal.data import image_folders

    cache = tmp_path / "cache"
    monkeypatch.setenv("PRIVFEDCAL_CACHE", str(cache))
    monkeypatch.setattr(image_folders, "CACHE_MIN_IMAGES", 0)
    root = imagefolder_root["root"]
    first = load_dataset(f"imagefolder:{root}")
    entries = sorted((cache / "imagefolder").glob("*.npy"))
    assert len(entries) == 2  # train and test arrays, no temporary files left behind
    stored = sorted(np.load(e, allow_pickle=False).shape[0] for e in entries)
    assert stored == [4, 6]

    def no_decoding(paths):
        raise AssertionError("decoded although the cache holds these files")

    monkeypatch.setattr(image_folders, "_decode_files", no_decoding)
    again = load_dataset(f"imagefolder:{root}")
    assert torch.equal(again.x_train, first.x_train) and torch.equal(again.x_test, first.x_test)
    np.testing.assert_array_equal(pixels_255(again, again.x_train), imagefolder_root["x_train"])

    # A changed file (new content, size and mtime) misses the cache and is decoded afresh.
    monkeypatch.undo()
    monkeypatch.setenv("PRIVFEDCAL_CACHE", str(cache))
    monkeypatch.setattr(image_folders, "CACHE_MIN_IMAGES", 0)
    changed = np.full((5, 6, 3), 7, np.uint8)
    write_png(root / "train" / "cat" / "00.png", changed)
    os.utime(root / "train" / "cat" / "00.png", ns=(1, 1))
    fresh = load_dataset(f"imagefolder:{root}")
    np.testing.assert_array_equal(pixels_255(fresh, fresh.x_train[:1])[0], changed.transpose(2, 0, 1))
    assert len(list((cache / "imagefolder").glob("*.npy"))) == 3

    # A corrupt entry is decoded again and replaced; "off" writes nothing.
    for e in (cache / "imagefolder").glob("*.npy"):
        e.write_bytes(b"garbage")
    assert torch.equal(load_dataset(f"imagefolder:{root}").x_train, fresh.x_train)
    monkeypatch.setenv("PRIVFEDCAL_CACHE", "off")
    assert image_folders.cache_dir() is None
    monkeypatch.delenv("PRIVFEDCAL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert image_folders.cache_dir() == tmp_path / "xdg" / "privfedcal"


def test_imagefolder_small_folders_are_not_cached(imagefolder_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVFEDCAL_CACHE", str(tmp_path / "cache"))
    load_dataset(f"imagefolder:{imagefolder_root['root']}")
    assert not (tmp_path / "cache").exists()
