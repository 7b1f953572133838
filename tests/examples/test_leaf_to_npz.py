"""examples/leaf_to_npz.py on generated files in LEAF's JSON format: pixels, labels and
users survive the conversion, privfedcal reads the result as a natural partition, and bad
files are refused in one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from privfedcal.data import load_dataset
from privfedcal.data.partition import PartitionSpec, client_sources, partition_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "leaf_to_npz.py"
SIDE = 4  # 4x4 images: LEAF's 784 values per row, shrunk


@pytest.fixture(scope="module")
def leaf():
    spec = importlib.util.spec_from_file_location("leaf_to_npz_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def user_data(rng, n: int) -> dict:
    # multiples of 1/255: round(255 x) gives back the integers exactly
    return {"x": (rng.integers(0, 256, (n, SIDE * SIDE)) / 255).tolist(),
            "y": rng.integers(0, 62, n).tolist()}


def write_leaf(path: Path, users: dict[str, dict]) -> None:
    """One LEAF JSON file (with the 'hierarchies' key FEMNIST's files carry, unused)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"users": list(users), "num_samples": [len(u["y"]) for u in users.values()],
                                "hierarchies": [], "user_data": users}))


@pytest.fixture
def leaf_split(tmp_path):
    """LEAF's train/ (users over two files) and test/ folders; 3 users of 6, 9 and 4 images."""
    rng = np.random.default_rng(0)
    train = {"f0003_41": user_data(rng, 6), "f0001_07": user_data(rng, 9), "f0002_33": user_data(rng, 4)}
    test = {name: user_data(rng, 2) for name in train}
    write_leaf(tmp_path / "train" / "all_data_0_niid_train.json", dict(list(train.items())[:2]))
    write_leaf(tmp_path / "train" / "all_data_1_niid_train.json", dict(list(train.items())[2:]))
    write_leaf(tmp_path / "test" / "all_data_0_niid_test.json", test)
    return tmp_path, train, test


def pixels(entry: dict) -> np.ndarray:
    return np.rint(np.array(entry["x"]) * 255).astype(np.uint8).reshape(-1, SIDE, SIDE)


def test_train_and_test_files(leaf, leaf_split, capsys):
    root, train, test = leaf_split
    out = root / "femnist.npz"
    assert leaf.main(["--train", str(root / "train"), "--test", str(root / "test"),
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 users, 19 training and 6 test images of 4x4, 62 classes" in printed
    assert f"privfedcal train --dataset npz:{out} --partition natural --clients 3" in printed
    with np.load(out, allow_pickle=False) as z:
        names = sorted(train)  # users numbered in sorted name order
        assert z["user_names"].tolist() == names
        np.testing.assert_array_equal(z["users"], np.repeat([0, 1, 2], [9, 4, 6]))
        np.testing.assert_array_equal(z["x_train"], np.concatenate([pixels(train[n]) for n in names]))
        np.testing.assert_array_equal(z["y_train"], np.concatenate([train[n]["y"] for n in names]))
        np.testing.assert_array_equal(z["x_test"], np.concatenate([pixels(u) for u in test.values()]))
        assert z["classes"].tolist()[:11] == [*"0123456789", "A"] and z["classes"][-1] == "z"
    ds = load_dataset(f"npz:{out}")
    parts = partition_dataset(ds, PartitionSpec(scheme="natural", num_clients=3, min_size=1), 0)
    assert [len(p) for p in parts] == [9, 4, 6]
    assert client_sources(ds, "natural") == {"client_users": names}


def test_holdout_of_samples_and_of_users(leaf, leaf_split):
    root, train, _ = leaf_split
    out = root / "h.npz"
    assert leaf.main(["--train", str(root / "train"), "--out", str(out)]) == 0
    with np.load(out) as z:
        # round(0.2 n) of every user's images held out: 9 -> 2, 4 -> 1, 6 -> 1
        assert np.bincount(z["users"]).tolist() == [7, 3, 5] and len(z["y_test"]) == 4
        assert z["x_train"].shape[0] + z["x_test"].shape[0] == 19
    assert leaf.main(["--train", str(root / "train"), "--holdout", "users", "--test-fraction",
                      "0.34", "--out", str(out)]) == 0
    with np.load(out) as z:  # round(0.34 * 3) = 1 whole user in the test set
        kept = z["user_names"].tolist()
        assert len(kept) == 2 and len(z["y_test"]) == 19 - len(z["y_train"])
        assert sorted(np.bincount(z["users"]).tolist()) == sorted(len(train[n]["y"]) for n in kept)


def test_min_samples_and_class_names(leaf, leaf_split, capsys):
    root, train, _ = leaf_split
    out = root / "m.npz"
    assert leaf.main(["--train", str(root / "train"), "--test", str(root / "test"), "--out",
                      str(out), "--min-samples", "5", "--classes", "labels"]) == 0
    assert "left out 1 users under --min-samples 5" in capsys.readouterr().out
    with np.load(out) as z:
        assert z["user_names"].tolist() == ["f0001_07", "f0003_41"]
        assert len(z["x_test"]) == 6  # the left-out user's test images stay
        assert z["classes"].tolist() == [str(c) for c in range(int(max(z["y_train"].max(), z["y_test"].max())) + 1)]


@pytest.mark.parametrize(("doc", "needle"), [
    ({"users": ["a"], "num_samples": [3], "user_data": {"a": {"x": [[0.5] * 16] * 2, "y": [1, 2]}}},
     "num_samples says 3 but it has 2 images"),
    ({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 16] * 2, "y": [1]}}}, "2 images but 1 labels"),
    ({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 15], "y": [1]}}}, "side*side"),
    ({"users": ["a"], "user_data": {"a": {"x": [[2.0] * 16], "y": [1]}}}, "pixels must lie in [0, 1]"),
    ({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 16], "y": [1.5]}}}, "labels must be integers"),
    ({"users": ["a", "b"], "user_data": {"a": {"x": [[0.5] * 16], "y": [1]}}}, "user b has no user_data"),
    ({"user_data": {}}, "needs 'users' and 'user_data'"),
])
def test_bad_files_are_one_line(leaf, tmp_path, capsys, doc, needle):
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    code = leaf.main(["--train", str(tmp_path / "bad.json"), "--out", str(tmp_path / "o.npz")])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o.npz").exists()
