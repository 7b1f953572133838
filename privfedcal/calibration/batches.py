"""A node's data as batches of ``(x, y)`` tensors, from the user's DataLoader or Dataset, and
a payload task computed over them without holding the whole data at once.

Flower-free (``privfedcal.api.ownloop`` uses it in a base install); the Flower plugin re-exports
it (``privfedcal.flower.plugin.data``).

Batches may be ``(x, y)`` pairs (torchvision style) or mappings (Hugging Face / Flower
Datasets style, ``{"img": ..., "label": ...}``), whose keys are found among common names or
given (``batch_keys=("img", "label")``). A ``Dataset`` is read through a ``DataLoader`` of
``batch_size`` in its own order. Calibration wants the node's training samples as they are:
give a loader without random augmentation (a fresh draw per pass would make each release
see other samples, and CReFF's per-class draw reads the data twice).

Payload tasks (``federation/hooks.py``) return sums over samples: CCVR's statistics and
CReFF's sample-weighted class gradients are summed batch by batch (``compute``). CReFF's
client weighting (per-class means and holder indicators) is computed as its sums and turned
into means at the end, as ``GradTask`` does. A task that draws a subset of the whole data
(CReFF's per-class cap) gets the samples concatenated once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sized
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from privfedcal.errors import UsageError
from privfedcal.federation.hooks import PayloadTask
from privfedcal.privacy.bound import Bound

__all__ = ["X_KEYS", "Y_KEYS", "batches", "compute", "num_samples"]

#: names under which a mapping batch holds its inputs and its labels (first found wins)
X_KEYS = ("img", "image", "images", "x", "input", "inputs", "pixel_values", "features")
Y_KEYS = ("label", "labels", "y", "target", "targets", "fine_label")


def _loader(data: Any, batch_size: int) -> Any:
    if isinstance(data, DataLoader):
        return data
    if isinstance(data, Dataset) or hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DataLoader(data, batch_size=batch_size, shuffle=False)
    raise UsageError(f"data must be a torch DataLoader or Dataset, got {type(data).__name__}")


def _pick(batch: Mapping[str, Any], names: tuple[str, ...], what: str) -> Any:
    for name in names:
        if name in batch:
            return batch[name]
    raise UsageError(f"a data batch has keys {sorted(batch)}, none of which names its {what}: "
                     "give batch_keys=(inputs key, labels key)")


def split_batch(batch: Any, batch_keys: tuple[str, str] | None = None) -> tuple[Tensor, Tensor]:
    """``(x, y)`` of one batch: a pair, or a mapping read by ``batch_keys`` or common names."""
    if isinstance(batch, Mapping):
        if batch_keys is not None:
            missing = [k for k in batch_keys if k not in batch]
            if missing:
                raise UsageError(f"batch_keys {missing} are not in a batch (keys "
                                 f"{sorted(batch)})")
            x, y = batch[batch_keys[0]], batch[batch_keys[1]]
        else:
            x, y = _pick(batch, X_KEYS, "inputs"), _pick(batch, Y_KEYS, "labels")
    elif isinstance(batch, list | tuple) and len(batch) >= 2:
        x, y = batch[0], batch[1]
    else:
        raise UsageError(f"a data batch must be (inputs, labels) or a mapping, got "
                         f"{type(batch).__name__}")
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise UsageError("a data batch must hold tensors (give the loader a ToTensor "
                         "transform)")
    if y.dim() != 1 or y.dtype.is_floating_point or y.shape[0] != x.shape[0]:
        raise UsageError(f"labels must be one integer class per sample, got shape "
                         f"{tuple(y.shape)} {y.dtype} for {x.shape[0]} inputs")
    return x, y.long()


def batches(data: Any, *, batch_size: int = 256, batch_keys: tuple[str, str] | None = None,
            device: Any = None, num_classes: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """The ``(x, y)`` batches of ``data`` on ``device``; labels outside ``num_classes``
    raise a one-line UsageError."""
    for batch in _loader(data, batch_size):
        x, y = split_batch(batch, batch_keys)
        if num_classes is not None and y.numel() and (int(y.min()) < 0
                                                      or int(y.max()) >= num_classes):
            raise UsageError(f"labels must be in 0..{num_classes - 1}, got "
                             f"{int(y.min())}..{int(y.max())}")
        yield x.to(device), y.to(device)


def num_samples(data: Any, **kwargs: Any) -> int:
    """How many samples ``data`` holds (its dataset's length, else counted batch by batch)."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    try:
        return len(cast(Sized, dataset))  # torch's Dataset declares no __len__
    except TypeError:  # an iterable dataset: count it
        return sum(int(y.shape[0]) for _, y in batches(data, **kwargs))


def _whole_data(task: PayloadTask) -> bool:
    """Whether ``task`` draws from all the node's samples at once (CReFF's per-class cap)."""
    return getattr(task, "per_class_cap", None) is not None


def compute(task: PayloadTask, model: Any, data: Any, bound: Bound, **kwargs: Any
            ) -> dict[str, Tensor]:
    """``task.compute`` over every sample of ``data``: sums batch by batch (see the module
    docstring), the same payload as ``task.compute`` on the concatenated data."""
    if _whole_data(task):
        parts = list(batches(data, **kwargs))
        if not parts:
            raise UsageError("the node's data is empty")
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        return task.compute(model, x, y, bound)
    means = getattr(task, "weighting", None) == "client"
    # a task with a weighting is a dataclass, which the PayloadTask protocol cannot state
    run = dataclasses.replace(cast(Any, task), weighting="sample") if means else task
    total: dict[str, Tensor] | None = None
    for x, y in batches(data, **kwargs):
        part = run.compute(model, x, y, bound)
        total = part if total is None else {k: total[k] + part[k] for k in total}
    if total is None:
        raise UsageError("the node's data is empty")
    if means:  # GradTask's client weighting: per-class means and holder indicators
        count = total["count"]
        grad = total["grad"] / count.clamp_min(1)[:, None, None]
        return {"grad": grad, "holders": (count > 0).double()}
    return total
