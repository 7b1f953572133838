"""Datasets as normalised tensors: digits (embedded), CIFAR-10/100, STL-10, image folders, npz.

Every loader returns a :class:`Dataset` whose images are float32 ``(N, C, H, W)`` tensors
normalised per channel with the training split's mean and std (pixels in [0, 1] before), so
the simulator gathers batches by index and never decodes per sample.

The on-disk formats of CIFAR and STL-10 are torchvision's. torchvision's dataset classes
check the md5 of every file on load, which rejects any file that is not the official
release (subsets, fixtures), so we only use them to *download* (``download=True``; they
verify the archive) and read the documented formats ourselves (``privfedcal.data.formats``):
CIFAR's pickled batches through an unpickler that resolves only the numpy array
constructors (local user files, never client/server traffic), STL-10's raw uint8 binaries.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from privfedcal.data.formats import (
    STL10_CLASSES,
    read_cifar_batch,
    read_npz,
    read_pickle,
    read_stl10_split,
)
from privfedcal.data.image_folders import read_domain_folders, read_split_folders
from privfedcal.errors import UsageError
from privfedcal.registry import Registry
from privfedcal.settings.messages import SettingError

DATASETS = ["digits", "cifar10", "cifar100", "stl10", "imagefolder", "npz"]
_CHOICES = "digits, cifar10, cifar100, stl10, imagefolder:PATH, npz:PATH"
_SPLIT_SEED = 0  # seeds the fixed digits and domain-folder train/test splits; never change it
_CNN_MIN_SIZE = 16  # the CCVR/MOON CNN (two 5x5 convs, two 2x2 pools) needs >= 16x16 inputs


@dataclasses.dataclass(eq=False, repr=False)
class Dataset:
    """A labelled image dataset held as tensors (train/test), normalised per channel."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool
    domains_train: Tensor | None = None
    domain_names: list[str] | None = None
    domains_test: Tensor | None = None
    #: the user of every training sample (``--partition natural``: one client per user) and
    #: the users' names by id; None where the files give no users
    users_train: Tensor | None = None
    user_names: list[str] | None = None

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.ndim != 4 or y.ndim != 1 or x.shape[0] != y.shape[0]:
                raise UsageError(f"{self.name}: {split} images must be (N, C, H, W) with N labels")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise UsageError(f"{self.name}: train and test images differ in shape")
        if not len(self.mean) == len(self.std) == self.in_channels:
            raise UsageError(f"{self.name}: need one mean and one std per channel")
        if self.domains_train is not None and self.domains_train.shape != self.y_train.shape:
            raise UsageError(f"{self.name}: need one domain id per training sample")
        if self.users_train is not None and self.users_train.shape != self.y_train.shape:
            raise UsageError(f"{self.name}: need one user id per training sample")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[2])

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    def to(self, device: torch.device | str) -> Dataset:
        """A new Dataset whose tensors live on ``device``."""
        move = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        move = {k: v.to(device) for k, v in move.items() if isinstance(v, Tensor)}
        return dataclasses.replace(self, **move)

    def denormalize(self, x: Tensor) -> Tensor:
        """Undo the normalisation: back to [0, 1] pixels (for attacks and plots)."""
        shape = (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return x * std + mean

    def __repr__(self) -> str:
        shape = tuple(self.x_train.shape[1:])
        return (f"Dataset({self.name!r}, train={self.num_train}, test={len(self.y_test)}, "
                f"shape={shape}, classes={self.num_classes}, device={self.x_train.device})")


def from_pixels(name: str, x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor,
                classes: list[str], *, augment: bool, **extra: object) -> Dataset:
    """Build a Dataset from (N, C, H, W) pixels (uint8 0..255 or float in [0, 1])."""
    stats = _uint8_channel_stats(x_train) if x_train.dtype == torch.uint8 else None
    x_train, x_test = _unit(x_train), _unit(x_test)
    if stats is None:
        std, mean = torch.std_mean(x_train, dim=(0, 2, 3), correction=0)
    else:
        mean, std = stats
    std = torch.where(std > 1e-12, std, torch.ones_like(std))  # constant channel: no scaling
    view = (1, -1, 1, 1)
    x_train.sub_(mean.view(view)).div_(std.view(view))
    x_test.sub_(mean.view(view)).div_(std.view(view))
    return Dataset(name, x_train, y_train.long(), x_test, y_test.long(), list(classes),
                   tuple(mean.tolist()), tuple(std.tolist()), augment, **extra)  # type: ignore[arg-type]


def _uint8_channel_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and population std of uint8 pixels, scaled to [0, 1]: exact (float64
    from 256-bin histograms) and one cheap pass instead of a float reduction over every pixel."""
    values = torch.arange(256, dtype=torch.float64) / 255.0
    means, stds = [], []
    for c in range(x.shape[1]):
        hist = torch.bincount(x[:, c].reshape(-1).cpu(), minlength=256).double()
        n = hist.sum()
        m = (hist * values).sum() / n
        means.append(m)
        stds.append(((hist * (values - m) ** 2).sum() / n).sqrt())
    return torch.stack(means).float(), torch.stack(stds).float()


def _unit(x: Tensor) -> Tensor:
    if x.dtype == torch.uint8:
        return x.float().div_(255.0)
    return x.float().clone()  # clone: normalisation below works in place


Loader = Callable[[str, Path | None, bool], Dataset]  # (PATH argument, data root, download)
LOADERS: Registry[Loader] = Registry("dataset")


def load_dataset(spec: str, data_root: str | Path | None = None, *,
                 download: bool = False) -> Dataset:
    """Load ``digits``, ``cifar10``, ``cifar100``, ``stl10``, ``imagefolder:PATH`` or ``npz:PATH``.

    - digits: scikit-learn's 8x8 digits (shipped in the package), a fixed stratified split
      (round(n_c/4) test images of every class, seed 0); no augmentation.
    - cifar10/cifar100/stl10: torchvision's folders under ``data_root``; ``download`` fetches
      them there first.
    - imagefolder:PATH: ``PATH/train/<class>/*`` and ``PATH/test/<class>/*`` (``valid/`` is
      ignored), or ``PATH/<domain>/<class>/*``: every domain keeps round(20%) of its images for
      test (fixed seed per domain name) and ``domains_train`` holds each sample's domain.
      Users (``users_train``, for ``--partition natural``) are the user folders of
      ``PATH/train/<user>/<class>/*``, or the domain folders of ``PATH/<domain>/<class>/*``.
    - npz:PATH: see :func:`privfedcal.data.formats.read_npz` (its ``users`` array gives
      ``users_train``); augmented only with 3 channels.
    """
    name, sep, arg = spec.partition(":")
    if name not in LOADERS:
        raise UsageError(f"unknown dataset {spec!r}; valid choices: {_CHOICES}")
    takes_path = name in ("imagefolder", "npz")
    if takes_path and not arg:
        raise SettingError("dataset {name} needs a path: {dataset=}", name=name,
                           dataset=f"{name}:PATH")
    if sep and not takes_path:
        raise SettingError(f"dataset {name} takes no ':PATH' (use {{data_root}} for its folder)")
    root = Path(data_root).expanduser() if data_root is not None else None
    return LOADERS.get(name)(arg, root, download)


def default_model_for(name: str | Dataset, *, image_size: int | None = None) -> str:
    """The model a dataset trains by default: ``mlp`` for digits and tiny images, else ``cnn``.

    For ``imagefolder``/``npz`` the choice depends on the image size: pass a loaded Dataset
    (or ``image_size``); without a size they default to ``cnn``.
    """
    if isinstance(name, Dataset):
        name, image_size = name.name, name.image_size
    kind = name.partition(":")[0]
    if kind not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; valid choices: {_CHOICES}")
    if kind == "digits" or (image_size is not None and image_size < _CNN_MIN_SIZE):
        return "mlp"
    return "cnn"


def _stratified_test(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean test mask holding round(fraction * n_c) random samples of every class c."""
    mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        mask[idx[: int(fraction * len(idx) + 0.5)]] = True
    return mask


#: scikit-learn's digits (UCI optical handwritten digits, 1797 images of 8x8 pixels in 0..16),
#: shipped as uint8 arrays so that loading them needs neither scikit-learn nor its import time
DIGITS_FILE = Path(__file__).with_name("digits.npz")


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(1797, 8, 8) pixels in 0..16 and (1797,) labels, in scikit-learn's order."""
    with np.load(DIGITS_FILE, allow_pickle=False) as z:
        return z["images"], z["labels"]


@LOADERS.register("digits")
def _load_digits(_arg: str, _root: Path | None, _download: bool) -> Dataset:
    images, target = _digits_arrays()
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(target.astype(np.int64))
    test = torch.from_numpy(_stratified_test(target, 0.25, np.random.default_rng(_SPLIT_SEED)))
    classes = [str(c) for c in range(10)]
    return from_pixels("digits", x[~test], y[~test], x[test], y[test], classes, augment=False)


def _need_root(name: str, root: Path | None) -> Path:
    if root is None:
        raise SettingError("{name} is read from files: pass {data_root=} (and {download} "
                           "to fetch them there)", name=name, data_root="DIR")
    return root


def _fetch(name: str, root: Path, make: Callable[[], object]) -> None:
    """Download with torchvision (it verifies the archive's md5), then read it ourselves."""
    try:
        make()
    except Exception as exc:  # no network, disk full, bad archive: all end the same way
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"could not download {name} into {root} ({reason}); place the "
                         "extracted files there instead") from exc


def _check_files(name: str, folder: Path, files: list[str]) -> None:
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise SettingError("{name}: {missing} not found; pass {download} or place the "
                           "extracted {folder} folder under {parent}", name=name,
                           missing=folder / missing[0], folder=folder.name, parent=folder.parent)


_CIFAR = {  # folder, train files, test file, meta file, label key, class-names key
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch",
                "batches.meta", "labels", "label_names"),
    "cifar100": ("cifar-100-python", ["train"], "test", "meta", "fine_labels", "fine_label_names"),
}


def _load_cifar(name: str, root: Path | None, download: bool) -> Dataset:
    folder, train_files, test_file, meta_file, label_key, names_key = _CIFAR[name]
    root = _need_root(name, root)
    if download:
        import torchvision

        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        _fetch(name, root, lambda: cls(str(root), train=False, download=True))
    base = root / folder
    _check_files(name, base, [*train_files, test_file, meta_file])
    parts = [read_cifar_batch(base / f, label_key) for f in train_files]
    x_tr, y_tr = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    x_te, y_te = read_cifar_batch(base / test_file, label_key)
    classes = [str(c) for c in read_pickle(base / meta_file)[names_key]]
    return from_pixels(name, torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te),
                       torch.from_numpy(y_te), classes, augment=True)


LOADERS.register("cifar10")(lambda _a, root, dl: _load_cifar("cifar10", root, dl))
LOADERS.register("cifar100")(lambda _a, root, dl: _load_cifar("cifar100", root, dl))


@LOADERS.register("stl10")
def _load_stl10(_arg: str, root: Path | None, download: bool) -> Dataset:
    root = _need_root("stl10", root)
    if download:
        import torchvision

        _fetch("stl10", root, lambda: torchvision.datasets.STL10(str(root), "test", download=True))
    base = root / "stl10_binary"
    _check_files("stl10", base, ["train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin"])
    x_tr, y_tr = read_stl10_split(base, "train")
    x_te, y_te = read_stl10_split(base, "test")
    names_file = base / "class_names.txt"
    classes = names_file.read_text().split() if names_file.is_file() else list(STL10_CLASSES)
    return from_pixels("stl10", torch.from_numpy(x_tr), torch.from_numpy(y_tr),
                       torch.from_numpy(x_te), torch.from_numpy(y_te), classes, augment=True)


@LOADERS.register("npz")
def _load_npz(arg: str, _root: Path | None, _download: bool) -> Dataset:
    im = read_npz(Path(arg).expanduser())
    return from_pixels(f"npz:{arg}", im.x_train, im.y_train, im.x_test, im.y_test, im.classes,
                       augment=im.x_train.shape[1] == 3, users_train=im.users_train,
                       user_names=im.user_names)


@LOADERS.register("imagefolder")
def _load_imagefolder(arg: str, _root: Path | None, _download: bool) -> Dataset:
    path = Path(arg).expanduser()
    if not path.is_dir():
        raise UsageError(f"imagefolder: {path} is not a directory")
    name = f"imagefolder:{arg}"
    if (path / "train").is_dir():
        im = read_split_folders(path)
        return from_pixels(name, im.x_train, im.y_train, im.x_test, im.y_test, im.classes,
                           augment=True, users_train=im.users_train, user_names=im.user_names)
    split = read_domain_folders(path, test_fraction=0.2, seed_of=_domain_seed)
    # every domain folder is also a user (--partition natural: one client per folder, the
    # same clients as --partition domains)
    return from_pixels(name, split.x_train, split.y_train, split.x_test, split.y_test,
                       split.classes, augment=True, domains_train=split.domains_train,
                       domains_test=split.domains_test, domain_names=split.domain_names,
                       users_train=split.domains_train, user_names=split.domain_names)


def _domain_seed(domain: str) -> np.random.Generator:
    # Seeded by the domain's name, so adding or removing another domain leaves this split alone.
    return np.random.default_rng([_SPLIT_SEED, zlib.crc32(domain.encode())])


__all__ = ["DATASETS", "Dataset", "LOADERS", "default_model_for", "from_pixels", "load_dataset"]
