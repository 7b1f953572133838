"""CCVR's calibration with its protection from a federated loop of one's own (e.g. a
Flower strategy): a client's statistics, their DP release, and the server's re-training of
the head. Re-exported by ``privfedcal`` (docs/api.md).

The model is any ``torch.nn.Module`` whose head (output layer) is a ``torch.nn.Linear``,
named with ``head=`` or found (``models/head_adapter.py``: the features are the head's input, taken
with a hook, nothing renamed); privfedcal's own models (``FeatureClassifier``) are used as
they are. Every argument is checked (shapes, dtypes, finiteness, the number of classes) and
refused with a one-line ``UsageError`` naming it, before anything is computed or sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from privfedcal.api.arguments import check_that, options_of, python_surface, register_check
from privfedcal.errors import UsageError

if TYPE_CHECKING:
    from privfedcal.models.feature_classifier import FeatureClassifier

__all__ = ["calibrate_head", "ccvr_statistics", "privatize_statistics"]

STATS_KEYS = ("count", "sum", "outer")


register_check("nn.Module", check_that(lambda v: isinstance(v, nn.Module), "a torch.nn.Module"))
register_check("Tensor | DataLoader | Dataset", check_that(
    lambda v: isinstance(v, Tensor | DataLoader | Dataset),
    "a torch.Tensor, a DataLoader or a Dataset of (x, y)"))
register_check("tuple[str, str]", check_that(
    lambda v: isinstance(v, tuple | list) and len(v) == 2 and all(isinstance(k, str) for k in v),
    "a pair of batch keys (inputs key, labels key)"))


def _feature_model(model: nn.Module, head: str | None,
                   num_classes: int | None) -> FeatureClassifier:
    """``model`` as a ``FeatureClassifier``: itself if it is one (and no other head is
    named), else a ``HeadAdapter`` on its Linear head; ``num_classes`` must be the head's
    number of outputs."""
    from privfedcal.models.feature_classifier import FeatureClassifier
    from privfedcal.models.head_adapter import HeadAdapter

    if num_classes is not None and num_classes < 2:
        raise UsageError(f"num_classes must be >= 2, got {num_classes}")
    if isinstance(model, FeatureClassifier) and head in (None, "classifier"):
        out = model.classifier.out_features
        if num_classes is not None and out != num_classes:
            raise UsageError(f"num_classes={num_classes} differs from the model's "
                             f"classifier, which has {out} outputs")
        return model
    return HeadAdapter(model, head, num_classes)


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _tensor_batches(x: Tensor, y: Tensor | None, num_classes: int,
                    batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Whole tensors checked and cut into batches."""
    if y is None:
        raise UsageError("y is needed when x is a tensor (x, y: inputs and their labels)")
    if not x.is_floating_point():
        raise UsageError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 2 or x.shape[0] == 0:
        raise UsageError(f"x must hold one sample per row (n, ...) with n >= 1, got shape "
                         f"{tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise UsageError("x has NaN or Inf values")
    if y.dim() != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise UsageError(f"y must be a 1-d tensor of integer class labels, got shape "
                         f"{tuple(y.shape)} {y.dtype}")
    if y.shape[0] != x.shape[0]:
        raise UsageError(f"y has {y.shape[0]} labels for x's {x.shape[0]} samples")
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise UsageError(f"y must be in 0..{num_classes - 1} (num_classes={num_classes}), "
                         f"got {int(y.min())}..{int(y.max())}")
    for i in range(0, x.shape[0], batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size].long()


# python_surface checks ``x`` by its annotation's text: the loader types stay bare there
@python_surface
def ccvr_statistics(model: nn.Module, x: Tensor | DataLoader | Dataset,  # type: ignore[type-arg]
                    y: Tensor | None = None, num_classes: int | None = None, *,
                    clip: float | None = None, batch_size: int = 1024,
                    head: str | None = None,
                    batch_keys: tuple[str, str] | None = None) -> dict[str, Tensor]:
    """A client's CCVR upload: per-class ``count`` (C,), feature ``sum`` (C, d) and ``outer``
    sums of z z^T (C, d, d), float64, of the model's features (its head's input) over its
    data: ``x`` and ``y`` tensors, or ``x`` a DataLoader or Dataset of ``(x, y)`` batches
    (or mappings, read by ``batch_keys`` or common names) with ``y`` left out. ``num_classes``
    defaults to the head's number of outputs. ``clip`` bounds each feature's L2 norm
    (needed before ``privatize_statistics``). The model runs in eval mode, its mode is
    restored afterwards."""
    from privfedcal.calibration.batches import batches
    from privfedcal.calibration.ccvr import StatsTask
    from privfedcal.privacy.bound import NoBound
    from privfedcal.privacy.dp import L2Clip

    if clip is not None and not (clip > 0 and math.isfinite(clip)):
        raise UsageError(f"clip must be a finite number > 0, got {clip}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    net = _feature_model(model, head, num_classes)
    num_classes = int(net.classifier.out_features if num_classes is None else num_classes)
    device = _device(model)
    if isinstance(x, Tensor):
        parts = _tensor_batches(x, y, num_classes, batch_size)
    elif y is not None:
        raise UsageError("y must be left out when x is a DataLoader or Dataset (its batches "
                         "hold the labels)")
    else:
        parts = batches(x, batch_size=batch_size, batch_keys=batch_keys, device=device,
                        num_classes=num_classes)
    bound = NoBound() if clip is None else L2Clip({"feature": float(clip)})
    task = StatsTask(num_classes, batch_size=batch_size)
    was_training = model.training
    model.eval()
    total: dict[str, Tensor] | None = None
    try:
        for xb, yb in parts:
            if not xb.is_floating_point():
                raise UsageError(f"x's batches must be floating-point inputs, got {xb.dtype}")
            part = task.compute(net, xb.to(device), yb.to(device), bound)
            total = part if total is None else {k: total[k] + part[k] for k in total}
    finally:
        model.train(was_training)
    if total is None:
        raise UsageError("x holds no samples")
    if not all(bool(torch.isfinite(t).all()) for t in total.values()):
        raise UsageError("the model's features of x are not finite (NaN or Inf in x or in "
                         "the model)")
    return total


def _checked_stats(stats: Mapping[str, Tensor], name: str = "stats") -> dict[str, Tensor]:
    """``stats`` with exactly the keys count (C,), sum (C, d), outer (C, d, d), real and
    finite, or a one-line UsageError naming the key."""
    keys = sorted(stats)
    if keys != sorted(STATS_KEYS):
        raise UsageError(f"{name} must have the keys count, sum and outer "
                         f"(ccvr_statistics), got {', '.join(map(repr, keys)) or 'none'}")
    for key in STATS_KEYS:
        t = stats[key]
        if not (t.is_floating_point() or t.dtype == torch.long):
            raise UsageError(f"{name}[{key!r}] must be a real tensor, got {t.dtype}")
        if not bool(torch.isfinite(t).all()):
            raise UsageError(f"{name}[{key!r}] has NaN or Inf values")
    count, total, outer = (stats[k] for k in STATS_KEYS)
    if count.dim() != 1 or count.shape[0] < 2:
        raise UsageError(f"{name}['count'] must have shape (C,) with C >= 2 classes, got "
                         f"{tuple(count.shape)}")
    c = count.shape[0]
    if total.dim() != 2 or total.shape[0] != c or total.shape[1] < 1:
        raise UsageError(f"{name}['sum'] must have shape (C, d) = ({c}, d), got "
                         f"{tuple(total.shape)}")
    d = total.shape[1]
    if tuple(outer.shape) != (c, d, d):
        raise UsageError(f"{name}['outer'] must have shape (C, d, d) = ({c}, {d}, {d}), got "
                         f"{tuple(outer.shape)}")
    return {k: stats[k] for k in STATS_KEYS}


@python_surface
def privatize_statistics(stats: Mapping[str, Tensor], *, epsilon: float, delta: float,
                         clip: float) -> dict[str, Tensor]:
    """``stats`` (one client's, or a sum over clients) with Gaussian noise for one
    (epsilon, delta)-DP release of sample-level neighbours, the features clipped to ``clip``
    (``ccvr_statistics(..., clip=clip)``): sensitivities 1, clip and clip^2 for count, sum
    and outer, the noise multiplier from opacus' RDP accountant, noise from OS entropy.
    Privatize each client's upload before it leaves the client (or a secure sum of them);
    the epsilon holds for this one release. Statistics whose features exceed ``clip``
    (``trace(outer_c) > count_c clip^2`` for a class) are refused: the noise would not
    cover them."""
    from privfedcal.calibration.ccvr import CCVR, CCVR_RELEASE
    from privfedcal.privacy.accounting import ReleasePlan, plan_noise
    from privfedcal.privacy.dp import gaussian_mechanism
    from privfedcal.privacy.noise import noise_generator

    if not (0 < epsilon and math.isfinite(epsilon)) or not 0 < delta < 1:
        raise UsageError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    if not (clip > 0 and math.isfinite(clip)):
        raise UsageError(f"clip must be a finite number > 0, got {clip}")
    stats = _checked_stats(stats)
    # sum over a class of ||z||^2 is the trace of its outer sum: at most count * clip^2 when
    # every feature was clipped to clip (relative slack for float rounding)
    energy = torch.diagonal(stats["outer"].double(), dim1=1, dim2=2).sum(1)
    limit = stats["count"].double() * clip ** 2
    over = torch.nonzero(energy > limit * (1 + 1e-6) + 1e-12).flatten()
    if over.numel():
        c = int(over[0])
        raise UsageError(f"stats exceed clip={clip:g}: class {c} has sum of squared feature "
                         f"norms {float(energy[c]):.4g} > count x clip^2 = {float(limit[c]):.4g};"
                         f" compute them with ccvr_statistics(..., clip={clip:g})")
    (sigma,) = plan_noise(epsilon, delta, [ReleasePlan(CCVR_RELEASE, 1.0, 1)])
    (spec,) = CCVR.releases  # the sensitivities CCVR declares for its statistics
    sens = spec.sensitivities(stats.keys(), clip=clip, grad_clip=clip)
    return gaussian_mechanism(dict(stats), sens, sigma, noise_generator(),
                              budget=spec.budget())


@python_surface
def calibrate_head(model: nn.Module, stats: Mapping[str, Tensor], *,
                   virtual_per_class: int = 2000, seed: int = 0, head: str | None = None,
                   **retrain: Any) -> nn.Module:
    """CCVR's server step on the summed (and possibly noised) statistics of the clients:
    draw ``virtual_per_class`` features per present class from the class Gaussians and
    re-train ``model``'s head (its Linear output layer, ``head`` or found) on them, in
    place; returns ``model``. ``retrain``: ``RetrainParams`` fields (``lr``, ``steps``,
    ``epochs``, ``batch_size``, ...). ``stats`` must match the head: C = its outputs, d =
    its inputs."""
    from privfedcal.calibration.ccvr import CCVR, sample_virtual_features, virtual_counts
    from privfedcal.calibration.retrain import RetrainParams, retrain_head_of, write_head
    from privfedcal.calibration.stats import ClassStats
    from privfedcal.privacy.stages import symmetrise

    if virtual_per_class < 1:
        raise UsageError(f"virtual_per_class must be >= 1, got {virtual_per_class}")
    params = RetrainParams(**options_of(RetrainParams, retrain, "re-training option(s)"))
    stats = _checked_stats(stats)
    net = _feature_model(model, head, None)
    c, d = stats["sum"].shape
    outputs, inputs = net.classifier.out_features, net.classifier.in_features
    if (c, d) != (outputs, inputs):
        raise UsageError(f"stats are for {c} classes of {d} features, the model's head has "
                         f"{outputs} outputs of {inputs} inputs")
    if not bool((stats["count"] > 0.5).any()):
        raise UsageError("stats['count'] has no class with a count above 0.5: nothing to "
                         "calibrate on")
    # as the protected CCVR does: noised outer sums are symmetrised, and the sampler floors
    # the eigenvalues of each class covariance (calibration/ccvr.py)
    cs = ClassStats.from_payload(symmetrise({k: v.double() for k, v in stats.items()},
                                            CCVR.releases[0].symmetric))
    g = torch.Generator().manual_seed(seed)
    z, labels = sample_virtual_features(cs, virtual_counts(cs.count.cpu(), virtual_per_class), g)
    state = net.state_dict()
    weight, bias = retrain_head_of(state, z, labels, params, g)
    net.load_state_dict(write_head(state, weight, bias))
    return model
