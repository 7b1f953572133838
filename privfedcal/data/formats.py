"""Readers of the on-disk dataset formats (local user files; nothing here crosses the wire).

- CIFAR-10/100 (python version): pickled dicts ``{"data": uint8 (N, 3072), "labels" |
  "fine_labels": [...]}``, rows in channel-major order (1024 red, 1024 green, 1024 blue).
  Read through :class:`_ArrayUnpickler`, which resolves only the numpy array constructors,
  so a crafted file cannot run code.
- STL-10 binary: ``{split}_X.bin`` uint8 images stored column-major (3, 96, 96) each,
  ``{split}_y.bin`` uint8 labels 1..10.
- npz: ``x_train, y_train, x_test, y_test`` (optional ``classes``; optional ``users``, one
  user id per training image, with ``user_names``), see :func:`read_npz`.
- Image folders: ``image_folders.py``.
"""

from __future__ import annotations

import codecs
import dataclasses
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from privfedcal.errors import UsageError

try:  # numpy >= 2
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]

_ARRAY_MODULES = {"numpy", "numpy.core.multiarray", "numpy._core.multiarray",
                  "numpy.core.numeric", "numpy._core.numeric"}
_ARRAY_GLOBALS = {"_reconstruct": _multiarray._reconstruct, "scalar": _multiarray.scalar,
                  # numpy's stubs omit this private pickle helper, which exists at runtime
                  "_frombuffer": _numeric._frombuffer,  # type: ignore[attr-defined]
                  "ndarray": np.ndarray, "dtype": np.dtype}
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship",
                 "truck")


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts/lists/strings/numbers and numpy arrays; refuses every other global."""

    def find_class(self, module: str, name: str) -> object:
        if module in _ARRAY_MODULES and name in _ARRAY_GLOBALS:
            return _ARRAY_GLOBALS[name]
        if (module, name) == ("_codecs", "encode"):  # bytes pickled by Python 3 at protocol < 3
            return codecs.encode
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_pickle(path: Path) -> dict[str, object]:
    """A CIFAR-style pickled dict with str keys (Python 2 files are decoded as latin-1)."""
    try:
        with open(path, "rb") as fh:
            obj = _ArrayUnpickler(fh, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise UsageError(f"{path} is not a CIFAR batch file ({exc})") from exc
    if not isinstance(obj, dict):
        raise UsageError(f"{path} is not a CIFAR batch file (no dict inside)")
    return {_text(k): v for k, v in obj.items()}


def _text(s: object) -> str:
    return s.decode("latin1") if isinstance(s, bytes) else str(s)


def read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 3, 32, 32) and labels int64 (N,) of one CIFAR batch file."""
    batch = read_pickle(path)
    if "data" not in batch or label_key not in batch:
        raise UsageError(f"{path} lacks the 'data'/'{label_key}' entries of a CIFAR batch")
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise UsageError(f"{path}: expected (N, 3072) pixels and N labels, got {data.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def read_stl10_split(base: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """STL-10 ``split`` ("train"/"test"): uint8 (N, 3, 96, 96) and int64 labels 0..9."""
    raw = np.fromfile(base / f"{split}_X.bin", dtype=np.uint8)
    labels = np.fromfile(base / f"{split}_y.bin", dtype=np.uint8).astype(np.int64) - 1
    per_image = 3 * 96 * 96
    if raw.size % per_image or raw.size // per_image != labels.size:
        raise UsageError(f"{base}/{split}_X.bin does not hold {labels.size} 3x96x96 images")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UsageError(f"{base}/{split}_y.bin: labels must be 1..10")
    # Stored column-major: (N, C, W, H) -> (N, C, H, W).
    return raw.reshape(-1, 3, 96, 96).transpose(0, 1, 3, 2).copy(), labels


#: what a dataset archive holds, for error messages
NPZ_KEYS = "arrays x_train, y_train, x_test, y_test (and optionally classes)"


@dataclasses.dataclass(frozen=True)
class Images:
    """A dataset read from files: train/test pixels and labels, class names and, where the
    files give them, one user id per training image (``users_train``, int64 >= 0) with the
    users' names (``user_names[id]``; None: the ids are the names)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: list[str]
    users_train: Tensor | None = None
    user_names: list[str] | None = None


def user_ids(values: np.ndarray, n: int, where: str) -> Tensor:
    """``values`` as int64 user ids, checked: 1-D, one per training image, integers >= 0."""
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_:
        raise UsageError(f"{where}: user ids must be integers, not {values.dtype}")
    if values.ndim != 1 or len(values) != n:
        raise UsageError(f"{where}: need one user id per training image: {n} images but "
                         f"user ids of shape {values.shape}")
    if n and values.min() < 0:
        raise UsageError(f"{where}: user ids must be >= 0, got {int(values.min())}")
    return torch.from_numpy(values.astype(np.int64))


def read_npz(path: Path) -> Images:
    """Arrays ``x_train, y_train, x_test, y_test`` (and optional ``classes``) of an npz.

    Image layout rule: 3-D ``(N, H, W)`` is one channel; 4-D is ``(N, C, H, W)`` when dim 1
    has 1 or 3 entries, else ``(N, H, W, C)`` when the last dim has 1 or 3 entries. Integer
    pixels are 0..255, float pixels must lie in [0, 1]. Labels are integers 0..C-1; class
    names default to "0".."C-1" with C = largest label + 1. An optional ``users`` array gives
    the user of every training image (integers >= 0; ``--partition natural``), and an
    optional ``user_names`` array the name of every id 0..max(users).
    """
    if not path.is_file():
        raise UsageError(f"npz: {path} not found")
    # numpy reads anything that is not a zip as a single pickled array, and its error then
    # suggests allow_pickle: never an option here (nothing privfedcal loads is unpickled)
    if not zipfile.is_zipfile(path):
        raise UsageError(f"npz: {path} is not a valid dataset archive: expected a .npz (as "
                         f"written by numpy.savez) holding {NPZ_KEYS}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc):  # an object array: its items are pickles
            raise UsageError(f"npz: {path} holds object (pickled) arrays, which privfedcal "
                             f"does not load; store {NPZ_KEYS} as numeric arrays") from None
        raise UsageError(f"npz: {path} is not a valid dataset archive ({exc}); expected "
                         f"{NPZ_KEYS}") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise UsageError(f"npz: {path} is not a valid dataset archive ({exc}); expected "
                         f"{NPZ_KEYS}") from None
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
    if missing:
        raise UsageError(f"npz: {path} lacks array(s) {', '.join(missing)}; expected "
                         f"{NPZ_KEYS}")
    out = []
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or len(y) != len(x):
            raise UsageError(f"npz: y_{split} must be 1-D integers, one per image of x_{split}")
        if len(y) == 0 or y.min() < 0:
            raise UsageError(f"npz: y_{split} must be non-empty with labels >= 0")
        out += [_npz_pixels(x, split), torch.from_numpy(y.astype(np.int64))]
    if out[0].shape[1:] != out[2].shape[1:]:
        raise UsageError(f"npz: x_train {tuple(out[0].shape[1:])} and x_test "
                         f"{tuple(out[2].shape[1:])} differ in image shape")
    top = int(max(out[1].max(), out[3].max())) + 1
    classes = [str(c) for c in arrays["classes"]] if "classes" in arrays else [str(c) for c in range(top)]
    if len(classes) < top:
        raise UsageError(f"npz: {len(classes)} class names but labels go up to {top - 1}")
    users, names = None, None
    if "users" in arrays:
        users = user_ids(arrays["users"], len(out[1]), f"npz: {path} users")
        if "user_names" in arrays:
            names = [str(u) for u in np.asarray(arrays["user_names"]).reshape(-1)]
            if len(names) <= int(users.max()):
                raise UsageError(f"npz: {path} has {len(names)} user_names but user ids go "
                                 f"up to {int(users.max())}")
    return Images(out[0], out[1], out[2], out[3], classes, users, names)


def _npz_pixels(x: np.ndarray, split: str) -> Tensor:
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1] not in (1, 3):
        if x.shape[-1] not in (1, 3):
            raise UsageError(f"npz: x_{split} {x.shape} has no channel axis of size 1 or 3")
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4:
        raise UsageError(f"npz: x_{split} must be 3-D or 4-D, got shape {x.shape}")
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise UsageError(f"npz: integer x_{split} must hold pixels 0..255")
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.uint8))
    if not np.issubdtype(x.dtype, np.floating):
        raise UsageError(f"npz: x_{split} must be integer or float, not {x.dtype}")
    if x.size and not (np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0):
        raise UsageError(f"npz: float x_{split} must hold pixels in [0, 1] (divide by 255)")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
