"""Readers of the on-disk dataset formats (local user files; nothing here crosses the wire).

- CIFAR-10/100 (python version): pickled dicts ``{"data": uint8 (N, 3072), "labels" |
  "fine_labels": [...]}``, rows in channel-major order (1024 red, 1024 green, 1024 blue).
  Read through :class:`_ArrayUnpickler`, which resolves only the numpy array constructors,
  so a crafted file cannot run code.
- STL-10 binary: ``{split}_X.bin`` uint8 images stored column-major (3, 96, 96) each,
  ``{split}_y.bin`` uint8 labels 1..10.
- npz: ``x_train, y_train, x_test, y_test`` (optional ``classes``; optional ``users``, one
  user id per training image, with ``user_names``), see :func:`read_npz`.
- Image folders: ``PATH/train/<class>/*`` + ``PATH/test/<class>/*`` (a ``valid/`` folder,
  as in CINIC-10, is ignored), the same with a user level ``PATH/train/<user>/<class>/*``
  (and ``PATH/test/<class>/*`` or ``PATH/test/<user>/<class>/*``, pooled), or domain folders
  ``PATH/<domain>/<class>/*``. Decoded pixels of
  folders with at least :data:`CACHE_MIN_IMAGES` images are cached as ``.npy`` files (see
  :func:`cache_dir`), keyed by the file list, sizes and modification times, so a second run
  reads one array instead of decoding every image again.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
import pickle
import zipfile
from collections.abc import Callable
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
                  "_frombuffer": _numeric._frombuffer, "ndarray": np.ndarray, "dtype": np.dtype}
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship",
                 "truck")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"}
# Folders with fewer images decode faster than a cache lookup is worth; not worth a file.
CACHE_MIN_IMAGES = 1000
_CACHE_VERSION = b"privfedcal-imagefolder-v1"


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


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


@dataclasses.dataclass
class _Listing:
    """Image files in decoding order, their labels, and a fingerprint line per file
    (path relative to the dataset folder, size, mtime) that keys the decoded-pixel cache."""

    paths: list[str] = dataclasses.field(default_factory=list)
    labels: list[int] = dataclasses.field(default_factory=list)
    fingerprint: list[str] = dataclasses.field(default_factory=list)

    def add(self, folder: Path, rel: str, label: int) -> int:
        """Append the images of ``folder`` (sorted by name, hidden files skipped)."""
        with os.scandir(folder) as it:  # one directory read; file type from the entry
            entries = sorted((e for e in it if not e.name.startswith(".")
                              and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
                              and e.is_file()), key=lambda e: e.name)
        for e in entries:
            st = e.stat()
            self.paths.append(e.path)
            self.fingerprint.append(f"{rel}/{e.name}\0{st.st_size}\0{st.st_mtime_ns}\n")
        self.labels += [label] * len(entries)
        return len(entries)


def cache_dir() -> Path | None:
    """Where decoded image folders are cached; ``None`` when caching is off.

    ``$PRIVFEDCAL_CACHE`` when set (``off``, ``0`` or an empty value turn the cache off), else
    ``$XDG_CACHE_HOME/privfedcal``, else ``~/.cache/privfedcal``. Entries live under
    ``imagefolder/`` and may be deleted at any time.
    """
    env = os.environ.get("PRIVFEDCAL_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "privfedcal"


def _content_key(fingerprint: list[str]) -> str:
    """SHA-256 of every file's relative path, size and mtime, in decoding order."""
    h = hashlib.sha256(_CACHE_VERSION)
    h.update("".join(fingerprint).encode())
    return h.hexdigest()


def _decode(listing: _Listing) -> Tensor:
    """RGB uint8 (N, 3, H, W) of image files that must all share one size (cached on disk)."""
    paths = listing.paths
    folder = cache_dir() if len(paths) >= CACHE_MIN_IMAGES else None
    if folder is None:
        return _decode_files(paths)
    target = folder / "imagefolder" / f"{_content_key(listing.fingerprint)}.npy"
    if target.is_file():
        try:
            arr = np.load(target, allow_pickle=False)
            if arr.dtype == np.uint8 and arr.ndim == 4 and arr.shape[:2] == (len(paths), 3):
                return torch.from_numpy(arr)
        except (OSError, ValueError):
            pass  # unreadable or truncated entry: decode again and overwrite it
    pixels = _decode_files(paths)
    try:  # written under a temporary name, then renamed: readers never see a partial file
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, pixels.numpy(), allow_pickle=False)
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only or full cache location only costs the next run the decoding
    return pixels


def _decode_files(paths: list[str]) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    pixels = []
    for p in paths:
        try:
            with Image.open(p) as im:
                pixels.append(np.asarray(im.convert("RGB")))
        except (UnidentifiedImageError, OSError) as exc:
            raise UsageError(f"cannot read image {p} ({exc})") from exc
        if pixels[-1].shape != pixels[0].shape:
            h0, w0 = pixels[0].shape[:2]
            h, w = pixels[-1].shape[:2]
            raise UsageError(f"images differ in size: {paths[0]} is {w0}x{h0}, {p} is {w}x{h}; "
                             "resize them to one size first")
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous()


def _user_folders(folder: Path) -> list[Path] | None:
    """The user folders of a split laid out as ``<user>/<class>/*`` (every subfolder holds
    folders and no image), else None (``<class>/*``)."""
    subs = _subdirs(folder)
    if subs and all(_subdirs(d) and not any(f.suffix.lower() in IMAGE_SUFFIXES
                                            for f in d.iterdir() if f.is_file()) for d in subs):
        return subs
    return None


def read_split_folders(path: Path) -> Images:
    """``PATH/train/<class>/*`` and ``PATH/test/<class>/*``; classes sorted by folder name.

    With a user level, ``PATH/train/<user>/<class>/*``, every training image carries the id
    of its user (users numbered in folder-name order, ``user_names`` their folder names); the
    test split may have a user level too (``PATH/test/<user>/<class>/*``), which is pooled.
    """
    if not (path / "test").is_dir():
        raise UsageError(f"imagefolder: {path / 'test'} not found (need train/ and test/)")
    users = {split: _user_folders(path / split) for split in ("train", "test")}
    folders = {split: users[split] or [path / split] for split in ("train", "test")}
    names = {split: sorted({c.name for f in folders[split] for c in _subdirs(f)})
             for split in ("train", "test")}
    classes = names["train"]
    extra = sorted(set(names["test"]) - set(classes))
    if extra:
        raise UsageError(f"imagefolder: test class {extra[0]!r} has no folder in {path / 'train'}")
    out, owner = [], []
    for split in ("train", "test"):
        listing = _Listing()
        for j, folder in enumerate(folders[split]):
            rel = f"{split}/{folder.name}" if users[split] else split
            n = sum(listing.add(folder / name, f"{rel}/{name}", label)
                    for label, name in enumerate(classes) if (folder / name).is_dir())
            if split == "train":
                if users[split] and not n:
                    raise UsageError(f"imagefolder: user folder {folder} holds no images")
                owner += [j] * n
        if not listing.paths:
            raise UsageError(f"imagefolder: no images under {path / split}/<class>/")
        out += [_decode(listing), torch.tensor(listing.labels, dtype=torch.int64)]
    if out[0].shape[1:] != out[2].shape[1:]:
        raise UsageError(f"imagefolder: train and test images of {path} differ in size")
    if users["train"] is None:
        return Images(out[0], out[1], out[2], out[3], classes)
    return Images(out[0], out[1], out[2], out[3], classes,
                  torch.tensor(owner, dtype=torch.int64), [u.name for u in users["train"]])


@dataclasses.dataclass(frozen=True)
class DomainSplit:
    """Pixels of ``PATH/<domain>/<class>/*`` split into train/test within every domain."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: list[str]
    domain_names: list[str]
    domains_train: Tensor
    domains_test: Tensor


def read_domain_folders(path: Path, *, test_fraction: float,
                        seed_of: Callable[[str], np.random.Generator]) -> DomainSplit:
    """Every domain loses round(test_fraction * n_d) random images to the test split."""
    domains = _subdirs(path)
    if not domains or not all(_subdirs(d) for d in domains):
        raise UsageError(f"imagefolder: expected {path}/train/<class>/ and test/<class>/, or "
                         f"{path}/<domain>/<class>/ folders of images")
    classes = sorted({c.name for d in domains for c in _subdirs(d)})
    listing = _Listing()
    domain_ids: list[int] = []
    test_mask: list[np.ndarray] = []
    for j, d in enumerate(domains):
        n = 0
        for label, name in enumerate(classes):
            if (d / name).is_dir():
                n += listing.add(d / name, f"{d.name}/{name}", label)
        if not n:
            raise UsageError(f"imagefolder: domain {d} holds no images")
        mask = np.zeros(n, dtype=bool)
        mask[seed_of(d.name).permutation(n)[: int(test_fraction * n + 0.5)]] = True
        domain_ids += [j] * n
        test_mask.append(mask)
    x, y_all = _decode(listing), torch.tensor(listing.labels, dtype=torch.int64)
    dom, test = torch.tensor(domain_ids, dtype=torch.int64), torch.from_numpy(np.concatenate(test_mask))
    return DomainSplit(x[~test], y_all[~test], x[test], y_all[test], classes,
                       [d.name for d in domains], dom[~test], dom[test])
