"""Convert LEAF's FEMNIST JSON into privfedcal's ``npz:`` layout, one user id per image.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) stores a dataset as
JSON files (``data/femnist/data/all_data/*.json``, or ``train/*.json`` and ``test/*.json``
after its split), each of the form::

    {"users": ["f0000_14", ...], "num_samples": [154, ...],
     "user_data": {"f0000_14": {"x": [[784 floats in [0, 1]], ...], "y": [label, ...]}, ...}}

The output holds ``x_train`` (N, 28, 28) uint8 pixels (round(255 x)), ``y_train``, ``users``
(the user of every training image: its index in the sorted training user names),
``user_names`` (those names), ``x_test``, ``y_test`` and ``classes`` (FEMNIST's 62: the
digits, then A-Z, then a-z; ``--classes labels`` names them by number), which
``privfedcal train --dataset npz:OUT --partition natural --clients U`` reads as one client per
user. The test split is pooled: it is never a client.

- ``--train`` and ``--test``: LEAF's own split (by default a per-user split of samples):
  the test files' images, whoever wrote them, are the test set.
- ``--train`` alone: ``--holdout samples`` (default) keeps round(f N_u) random images of
  every user u for test (f = ``--test-fraction``, drawn per user from ``--seed`` and the
  user's name), so every user with an image keeps at least one for training; ``--holdout
  users`` moves round(f U) random users, all their images, to the test set.

A user with no training image is not a client (it cannot be one). ``--min-samples N``
leaves users with fewer than N training images out of the training set (LEAF's ``--k``);
their test images stay in the pooled test set. Bad input is one line on stderr, exit 2.

    python examples/leaf_to_npz.py --train leaf/data/femnist/data/train \\
        --test leaf/data/femnist/data/test --out femnist.npz
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from pathlib import Path

import numpy as np

FEMNIST_CLASSES = [*"0123456789", *(chr(c) for c in range(65, 91)), *(chr(c) for c in range(97, 123))]


class Bad(Exception):
    """Input that cannot be converted; its text is the one line printed."""


def json_files(paths: list[Path]) -> list[Path]:
    """The ``.json`` files of ``paths`` (a folder gives its own, sorted by name)."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix == ".json" and f.is_file())
            if not found:
                raise Bad(f"{p}: no .json files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise Bad(f"{p}: not found")
    return files


def read_users(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every user's (pixels float32 (n, D), labels int64 (n,)) over ``files``."""
    users: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    width = None
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Bad(f"{f}: not a LEAF JSON file ({exc})") from None
        if not isinstance(doc, dict) or not {"users", "user_data"} <= doc.keys():
            raise Bad(f"{f}: not a LEAF JSON file (needs 'users' and 'user_data')")
        counts = doc.get("num_samples", [None] * len(doc["users"]))
        if len(counts) != len(doc["users"]):
            raise Bad(f"{f}: {len(doc['users'])} users but {len(counts)} num_samples")
        for name, count in zip(doc["users"], counts, strict=True):
            where = f"{f}: user {name}"
            if name in users:
                raise Bad(f"{where} appears twice (pass each LEAF file once)")
            if name not in doc["user_data"]:
                raise Bad(f"{where} has no user_data")
            x, y = _user_arrays(doc["user_data"][name], where)
            if count is not None and count != len(y):
                raise Bad(f"{where}: num_samples says {count} but it has {len(y)} images")
            if len(y) and width is not None and x.shape[1] != width:
                raise Bad(f"{where}: images of {x.shape[1]} values, others have {width}")
            width = x.shape[1] if len(y) else width
            users[str(name)] = (x, y)
    return users


def _user_arrays(entry: object, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
        raise Bad(f"{where}: needs 'x' and 'y'")
    try:
        x = np.asarray(entry["x"], dtype=np.float32)
        y_raw = np.asarray(entry["y"])
    except (ValueError, TypeError):
        raise Bad(f"{where}: 'x' must be rows of numbers of one length") from None
    if len(x) != len(y_raw):
        raise Bad(f"{where}: {len(x)} images but {len(y_raw)} labels")
    if not len(x):
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    if x.ndim != 2 or math.isqrt(x.shape[1]) ** 2 != x.shape[1]:
        raise Bad(f"{where}: every image must be a flat list of side*side values")
    if not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
        raise Bad(f"{where}: pixels must lie in [0, 1]")
    if y_raw.ndim != 1 or not np.issubdtype(y_raw.dtype, np.integer) or y_raw.min() < 0:
        raise Bad(f"{where}: labels must be integers >= 0")
    return x, y_raw.astype(np.int64)


def holdout(users: dict[str, tuple[np.ndarray, np.ndarray]], how: str, fraction: float,
            seed: int) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[tuple[np.ndarray, np.ndarray]]]:
    """Split ``users`` into (training users, test pieces) as ``--holdout`` says."""
    train: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    test: list[tuple[np.ndarray, np.ndarray]] = []
    if how == "users":
        names = sorted(users)
        order = np.random.default_rng(seed).permutation(len(names))
        held = set(order[: int(fraction * len(names) + 0.5)].tolist())
        for i, name in enumerate(names):
            if i in held:
                test.append(users[name])
            else:
                train[name] = users[name]
        return train, test
    for name, (x, y) in users.items():
        # seeded by the user's name: adding or removing another user leaves this split alone
        order = np.random.default_rng([seed, zlib.crc32(name.encode())]).permutation(len(y))
        held = np.zeros(len(y), dtype=bool)
        held[order[: int(fraction * len(y) + 0.5)]] = True
        train[name] = (x[~held], y[~held])
        test.append((x[held], y[held]))
    return train, test


def stack(pieces: list[tuple[np.ndarray, np.ndarray]], side: int) -> tuple[np.ndarray, np.ndarray]:
    """(side x side uint8 images, labels) of the non-empty ``pieces``."""
    pieces = [p for p in pieces if len(p[1])]
    if not pieces:
        return np.zeros((0, side, side), np.uint8), np.zeros(0, np.int64)
    if any(p[0].shape[1] != side * side for p in pieces):
        raise Bad(f"the test images are not {side}x{side} as the training images are")
    x = np.concatenate([p[0] for p in pieces])
    pixels = np.rint(x * 255).astype(np.uint8).reshape(-1, side, side)
    return pixels, np.concatenate([p[1] for p in pieces])


def convert(args: argparse.Namespace) -> str:
    """Write ``args.out``; return the summary printed."""
    users = read_users(json_files(args.train))
    if args.test:
        test_users = read_users(json_files(args.test))
        train, test = users, list(test_users.values())
    else:
        if not 0 < args.test_fraction < 1:
            raise Bad(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
        train, test = holdout(users, args.holdout, args.test_fraction, args.seed)
    empty = [n for n, (_, y) in train.items() if not len(y)]
    small = [n for n, (_, y) in train.items() if 0 < len(y) < args.min_samples]
    kept = sorted(n for n, (_, y) in train.items() if len(y) and len(y) >= args.min_samples)
    if not kept:
        raise Bad("no user holds a training image (after --min-samples)")
    side = math.isqrt(train[kept[0]][0].shape[1])
    x_train, y_train = stack([train[n] for n in kept], side)
    x_test, y_test = stack(test, side)
    if not len(y_test):
        raise Bad("the test split is empty: give --test files or a larger --test-fraction")
    top = int(max(y_train.max(), y_test.max()))
    if args.classes == "femnist":
        if top >= len(FEMNIST_CLASSES):
            raise Bad(f"label {top} is past FEMNIST's 62 classes; use --classes labels")
        classes = FEMNIST_CLASSES
    else:
        classes = [str(c) for c in range(top + 1)]
    ids = np.repeat(np.arange(len(kept)), [len(train[n][1]) for n in kept])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = np.savez_compressed if args.compress else np.savez
    with open(args.out, "wb") as fh:  # a file object: numpy appends no .npz to the name
        save(fh, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
             users=ids, user_names=np.array(kept), classes=np.array(classes))
    sizes = np.bincount(ids)
    return (f"wrote {args.out}: {len(kept)} users, {len(y_train)} training and {len(y_test)} "
            f"test images of {side}x{side}, {len(classes)} classes; images per user: min "
            f"{sizes.min()}, median {np.median(sizes):g}, max {sizes.max()}"
            + (f"; left out {len(small)} users under --min-samples {args.min_samples}"
               if small else "")
            + (f"; {len(empty)} users had no training image" if empty else "")
            + f"\ntrain with: privfedcal train --dataset npz:{args.out} --partition natural "
            f"--clients {len(kept)}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=Path, nargs="+", required=True,
                   help="LEAF JSON files or folders of them (all_data/ or train/)")
    p.add_argument("--test", type=Path, nargs="+", help="LEAF's test JSON files or folders")
    p.add_argument("--out", type=Path, required=True, help="the .npz file to write")
    p.add_argument("--holdout", choices=("samples", "users"), default="samples",
                   help="without --test: hold out a fraction of every user's images, or of the users")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0, help="seed of the --holdout draw")
    p.add_argument("--min-samples", type=int, default=1,
                   help="leave out users with fewer training images")
    p.add_argument("--classes", choices=("femnist", "labels"), default="femnist")
    p.add_argument("--compress", action="store_true", help="write a compressed .npz")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        print(convert(args))
    except Bad as exc:
        print(f"leaf_to_npz: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
