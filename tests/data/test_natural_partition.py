"""Natural partitions: user ids read from npz and image folders, one client per user."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.data import load_dataset
from privfedcal.data.partition import (
    PartitionSpec,
    client_sources,
    partition_dataset,
    partition_indices,
)
from privfedcal.errors import UsageError
from privfedcal.federation.setup import server_dataset


def write_png(path, pixels: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def natural(k: int, min_size: int = 1) -> PartitionSpec:
    return PartitionSpec(scheme="natural", num_clients=k, min_size=min_size)


def write_npz(path, users, *, n_test=3, **extra) -> None:
    """12 (or one per user id) 8x8 grayscale training images, 3 classes, and ``users``."""
    rng = np.random.default_rng(0)
    n = max(len(users), 12)
    np.savez(path, x_train=rng.integers(0, 256, (n, 8, 8), dtype=np.uint8),
             y_train=np.arange(n) % 3, x_test=rng.integers(0, 256, (n_test, 8, 8), dtype=np.uint8),
             y_test=np.arange(n_test) % 3, users=users, **extra)


def test_client_k_holds_the_user_with_the_kth_smallest_id():
    labels = np.array([0, 1, 2, 0, 1, 2, 0])
    users = np.array([7, 3, 7, 42, 3, 3, 7])  # ids need not be contiguous
    parts = partition_indices(labels, natural(3), seed=0, users=users)
    assert [p.tolist() for p in parts] == [[1, 4, 5], [0, 2, 6], [3]]
    assert all(p.dtype == np.int64 for p in parts)
    # nothing is drawn: any seed gives the same clients
    again = partition_indices(labels, natural(3), seed=99, users=users)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=40, deadline=None)
@given(users=st.lists(st.integers(0, 30), min_size=1, max_size=80).map(np.array))
def test_every_sample_on_its_users_client(users):
    labels = np.zeros(len(users), dtype=np.int64)
    ids = np.unique(users)
    parts = partition_indices(labels, natural(len(ids)), 0, users=users)
    for k, p in enumerate(parts):
        np.testing.assert_array_equal(p, np.flatnonzero(users == ids[k]))
    assert sum(map(len, parts)) == len(users)


def test_natural_refusals_are_one_line():
    labels, users = np.zeros(6, dtype=np.int64), np.array([0, 0, 0, 1, 1, 2])
    cases = [
        (natural(10), None, "needs a user id per training sample"),
        (natural(10), users, "the data hold 3 users, so set clients to 3, not 10"),
        (natural(3), users[:5], "one integer user id per training sample"),
        (natural(3), users.astype(float), "one integer user id per training sample"),
        (natural(3, min_size=2), users, "user 2 (client 2) holds 1 training samples, fewer "
                                        "than min size 2"),
    ]
    for spec, u, message in cases:
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as exc:
            partition_indices(labels, spec, 0, users=u)
        assert "\n" not in str(exc.value)


def test_npz_users_make_the_clients(tmp_path):
    users = np.array([5, 1, 5, 5, 1, 9, 9, 9, 9, 1, 5, 5])
    path = tmp_path / "u.npz"
    write_npz(path, users, user_names=np.array([f"writer{i:02d}" for i in range(10)]))
    ds = load_dataset(f"npz:{path}")
    np.testing.assert_array_equal(ds.users_train.numpy(), users)
    parts = partition_dataset(ds, natural(3), 0)
    assert [len(p) for p in parts] == [3, 5, 4]  # users 1, 5, 9
    assert client_sources(ds, "natural") == {"client_users": ["writer01", "writer05", "writer09"]}
    assert client_sources(ds, "dirichlet") == {}
    # the test split is the file's own: x_test/y_test, whoever they came from
    assert len(ds.y_test) == 3
    # the server's dataset holds no user ids, as it holds no training sample
    server = server_dataset(ds)
    assert server.users_train.numel() == 0 and server.num_train == 0


@pytest.mark.parametrize(("users", "extra", "match"), [
    (np.arange(11), {}, r"12 images but user ids of shape \(11,\)"),
    (np.zeros((12, 1), dtype=np.int64), {}, r"12 images but user ids of shape \(12, 1\)"),
    (np.arange(12) + 0.5, {}, "user ids must be integers, not float64"),
    (np.array([f"u{i}" for i in range(12)]), {}, "user ids must be integers"),
    (np.full(12, True), {}, "user ids must be integers, not bool"),
    (np.arange(12) - 1, {}, "user ids must be >= 0, got -1"),
    (np.arange(12), {"user_names": np.array(["a", "b"])}, "2 user_names but user ids go up to 11"),
])
def test_bad_npz_users_are_refused_at_load(tmp_path, users, extra, match):
    path = tmp_path / "bad.npz"
    write_npz(path, users, **extra)
    with pytest.raises(UsageError, match=match) as exc:
        load_dataset(f"npz:{path}")
    assert "\n" not in str(exc.value)


def test_npz_without_users_has_none(tmp_path):
    path = tmp_path / "plain.npz"
    np.savez(path, x_train=np.zeros((4, 8, 8), np.uint8), y_train=np.array([0, 1, 0, 1]),
             x_test=np.zeros((2, 8, 8), np.uint8), y_test=np.array([0, 1]))
    ds = load_dataset(f"npz:{path}")
    assert ds.users_train is None and client_sources(ds, "natural") == {}
    with pytest.raises(UsageError, match="a 'users' array in npz:PATH"):
        partition_dataset(ds, natural(2), 0)


def user_folders(root, layout: dict[str, dict[str, int]], *, test_users: bool) -> None:
    """``train/<user>/<class>/`` with ``layout[user][class]`` images and a test split of two
    images per class, under ``test/<user0>/<class>/`` or ``test/<class>/``."""
    rng = np.random.default_rng(1)
    classes = sorted({c for per in layout.values() for c in per})
    for user, per in layout.items():
        for cls, n in per.items():
            for i in range(n):
                write_png(root / "train" / user / cls / f"{i}.png",
                          rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    for cls in classes:
        for i in range(2):
            folder = root / "test" / ("someone" if test_users else "") / cls
            write_png(folder / f"{i}.png", rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))


@pytest.mark.parametrize("test_users", [False, True])
def test_imagefolder_user_level(tmp_path, test_users):
    layout = {"bob": {"cat": 2, "dog": 1}, "alice": {"dog": 4}, "carol": {"cat": 1, "emu": 2}}
    user_folders(tmp_path, layout, test_users=test_users)
    ds = load_dataset(f"imagefolder:{tmp_path}")
    assert ds.classes == ["cat", "dog", "emu"] and ds.user_names == ["alice", "bob", "carol"]
    # users in folder-name order, each user's classes in class order
    assert ds.users_train.tolist() == [0] * 4 + [1] * 3 + [2] * 3
    assert ds.y_train.tolist() == [1] * 4 + [0, 0, 1] + [0, 2, 2]
    assert ds.y_test.tolist() == [0, 0, 1, 1, 2, 2]  # pooled, not a client
    parts = partition_dataset(ds, natural(3), 0)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert client_sources(ds, "natural") == {"client_users": ["alice", "bob", "carol"]}


def test_imagefolder_without_user_level_has_no_users(imagefolder_root):
    ds = load_dataset(f"imagefolder:{imagefolder_root['root']}")
    assert ds.users_train is None and ds.classes == ["cat", "dog"]


def test_imagefolder_empty_user_is_refused(tmp_path):
    user_folders(tmp_path, {"bob": {"cat": 2}}, test_users=False)
    (tmp_path / "train" / "ghost" / "cat").mkdir(parents=True)
    with pytest.raises(UsageError, match="user folder .*ghost holds no images"):
        load_dataset(f"imagefolder:{tmp_path}")


def test_domain_folders_are_users_too(domains_root):
    """``PATH/<user>/<class>/``: every folder keeps round(20%) of its images for test (the
    domain split), the rest is its client: the same clients as ``--partition domains``."""
    ds = load_dataset(f"imagefolder:{domains_root}")
    assert torch.equal(ds.users_train, ds.domains_train) and ds.user_names == ["art", "photo"]
    nat = partition_dataset(ds, natural(2), 0)
    dom = partition_dataset(ds, PartitionSpec(scheme="domains", num_clients=2, min_size=1), 0)
    assert [p.tolist() for p in nat] == [p.tolist() for p in dom]
    assert [len(p) for p in nat] == [8, 4]  # art 10 - round(2.0), photo 5 - round(1.0)
