"""Image folders as datasets: ``PATH/train/<class>/*`` + ``PATH/test/<class>/*`` (a ``valid/``
folder, as in CINIC-10, is ignored), the same with a user level ``PATH/train/<user>/<class>/*``
(and ``PATH/test/<class>/*`` or ``PATH/test/<user>/<class>/*``, pooled), or domain folders
``PATH/<domain>/<class>/*`` (local user files; nothing here crosses the wire).

Decoded pixels of folders with at least :data:`CACHE_MIN_IMAGES` images are cached as
``.npy`` files (see :func:`cache_dir`), keyed by the file list, sizes and modification
times, so a second run reads one array instead of decoding every image again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from privfedcal.data.formats import Images
from privfedcal.errors import UsageError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"}
# Folders with fewer images decode faster than a cache lookup is worth; not worth a file.
CACHE_MIN_IMAGES = 1000
_CACHE_VERSION = b"privfedcal-imagefolder-v1"


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
