"""CCVR's calibration with its protection from a federated loop of one's own (e.g. a
Flower strategy): a client's statistics, their DP release, and the server's re-training of
the head. Re-exported by ``privfedcal`` (docs/api.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.pysurface import options_of, python_surface

if TYPE_CHECKING:
    from privfedcal.models.base import FeatureClassifier

__all__ = ["calibrate_head", "ccvr_statistics", "privatize_statistics"]


@python_surface
def ccvr_statistics(model: FeatureClassifier, x: Tensor, y: Tensor, num_classes: int, *,
                    clip: float | None = None, batch_size: int = 1024) -> dict[str, Tensor]:
    """A client's CCVR upload: per-class ``count`` (C,), feature ``sum`` (C, d) and ``outer``
    sums of z z^T (C, d, d), float64, of the model's features of (x, y). ``clip`` bounds
    each feature's L2 norm (needed before ``privatize_statistics``). ``model`` must be a
    ``FeatureClassifier`` (``features(x)`` and a ``classifier`` head), as privfedcal's
    models are."""
    from privfedcal.calibration.ccvr import StatsTask
    from privfedcal.privacy.bound import NoBound
    from privfedcal.privacy.dp import L2Clip

    bound = NoBound() if clip is None else L2Clip({"feature": float(clip)})
    model.eval()
    return StatsTask(num_classes, batch_size=batch_size).compute(model, x, y, bound)


@python_surface
def privatize_statistics(stats: Mapping[str, Tensor], *, epsilon: float, delta: float,
                         clip: float) -> dict[str, Tensor]:
    """``stats`` (one client's, or a sum over clients) with Gaussian noise for one
    (epsilon, delta)-DP release of sample-level neighbours, the features clipped to ``clip``
    (``ccvr_statistics(..., clip=clip)``): sensitivities 1, clip and clip^2 for count, sum
    and outer, the noise multiplier from opacus' RDP accountant, noise from OS entropy.
    Privatize each client's upload before it leaves the client (or a secure sum of them);
    the epsilon holds for this one release."""
    from privfedcal.calibration.ccvr import CCVR_RELEASE
    from privfedcal.privacy.accounting import ReleasePlan, plan_noise
    from privfedcal.privacy.dp import gaussian_mechanism, payload_sensitivities
    from privfedcal.privacy.noise import noise_generator

    if not (0 < epsilon and math.isfinite(epsilon)) or not 0 < delta < 1:
        raise UsageError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    if not (clip > 0 and math.isfinite(clip)):
        raise UsageError(f"clip must be a finite number > 0, got {clip}")
    (sigma,) = plan_noise(epsilon, delta, [ReleasePlan(CCVR_RELEASE, 1.0, 1)])
    sens = payload_sensitivities(stats.keys(), clip=clip, grad_clip=clip)
    return gaussian_mechanism(dict(stats), sens, sigma, noise_generator())


@python_surface
def calibrate_head(model: FeatureClassifier, stats: Mapping[str, Tensor], *,
                   virtual_per_class: int = 2000, seed: int = 0,
                   **retrain: Any) -> FeatureClassifier:
    """CCVR's server step on the summed (and possibly noised) statistics of the clients:
    draw ``virtual_per_class`` features per present class from the class Gaussians and
    re-train ``model``'s classifier head on them, in place; returns ``model``. ``retrain``:
    ``RetrainParams`` fields (``lr``, ``steps``, ``epochs``, ``batch_size``, ...)."""
    from privfedcal.calibration.ccvr import sample_virtual_features, virtual_counts
    from privfedcal.calibration.retrain import RetrainParams, retrain_head_of, write_head
    from privfedcal.calibration.stats import ClassStats
    from privfedcal.privacy.stages import symmetrise_outer

    if virtual_per_class < 1:
        raise UsageError(f"virtual_per_class must be >= 1, got {virtual_per_class}")
    params = RetrainParams(**options_of(RetrainParams, retrain, "re-training option(s)"))
    # as the protected CCVR does: noised outer sums are symmetrised, and the sampler floors
    # the eigenvalues of each class covariance (calibration/ccvr.py)
    cs = ClassStats.from_payload(symmetrise_outer(dict(stats)))
    g = torch.Generator().manual_seed(seed)
    z, labels = sample_virtual_features(cs, virtual_counts(cs.count.cpu(), virtual_per_class), g)
    state = model.state_dict()
    weight, bias = retrain_head_of(state, z, labels, params, g)
    model.load_state_dict(write_head(state, weight, bias))
    return model
