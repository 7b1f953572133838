"""CCVR: Classifier Calibration with Virtual Representations (Luo et al., NeurIPS 2021).

After federated training the server (1) collects per-class feature statistics from every
client, as additive sums (``ClassStats``; equivalent to the paper's Eq. 3-4 merge), (2) fits
one Gaussian ``N(mu_c, Sigma_c)`` per class and draws virtual features from it (Algorithm 1),
(3) re-trains only the classifier, initialised from the global one, on those features with
cross-entropy (sec. 4, "Classifier Re-Training").

Choices where the paper is silent (documented in ``CCVRParams``):

* re-training: SGD lr 0.01, momentum 0.9, batch 64, 10 epochs over the virtual set and at
  least 100 steps (``RetrainParams``);
* ``virtual_mode="proportional"`` distributes ``M * C`` features by ``N_c / N`` (largest
  remainder rounding, so the total is exact);
* covariances are repaired before sampling: eigenvalues are floored at
  ``eig_floor * max(lambda_max, 0) + 1e-8``, so noisy (DP) or rank-deficient covariances never
  fail or give NaN; classes with count < 2 get their mean repeated (zero covariance);
* with ``tukey`` the client computes ``relu_tukey(z)`` and clips *after* the transform, so the
  clip bound applies to exactly what is summed; the same transform is then applied to real
  features at inference (``feature_transform``), once the calibrated head is in place.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from privfedcal.calibration.retrain import PosthocCalibrator, RetrainParams, retrain_head_of
from privfedcal.calibration.stats import ClassStats
from privfedcal.calibration.transforms import relu_tukey
from privfedcal.errors import UsageError
from privfedcal.federation.hooks import CALIBRATORS, Bound, FeatureTransform, Payload, ServerContext
from privfedcal.federation.local import CPU_INFERENCE_BATCH
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.releases import ReleaseSpec
from privfedcal.settings.descriptions import calibration_option

VIRTUAL_MODES = ("balanced", "proportional")


@dataclass(frozen=True)
class CCVRParams(RetrainParams):
    """``virtual_per_class`` M (paper: 100 CIFAR-10, 500 CIFAR-100, 1000 CINIC-10)."""

    virtual_per_class: int = calibration_option(100, "CCVR virtual features per class M.")
    virtual_mode: str = calibration_option("balanced", "CCVR M_c: balanced | proportional")
    tukey: bool = calibration_option(False, "CCVR ReLU + Tukey transform.")
    tukey_lambda: float = 0.5
    eig_floor: float = 1e-6
    feature_batch_size: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.virtual_per_class < 1:
            raise UsageError(f"CCVR virtual features per class must be >= 1, got {self.virtual_per_class}")
        if self.virtual_mode not in VIRTUAL_MODES:
            raise UsageError(f"CCVR virtual mode must be one of {', '.join(VIRTUAL_MODES)}, got {self.virtual_mode!r}")
        if not self.tukey_lambda >= 0:
            raise UsageError(f"Tukey lambda must be >= 0, got {self.tukey_lambda}")
        if not self.eig_floor >= 0:
            raise UsageError(f"CCVR eigenvalue floor must be >= 0, got {self.eig_floor}")
        if self.feature_batch_size < 1:
            raise UsageError(f"feature batch size must be >= 1, got {self.feature_batch_size}")


def extract_features(model: FeatureClassifier, x: Tensor, batch_size: int) -> Tensor:
    """``model.features`` over ``x`` in batches of ``batch_size`` (at most
    ``CPU_INFERENCE_BATCH`` on a CPU), without gradients."""
    if x.device.type == "cpu":
        batch_size = min(batch_size, CPU_INFERENCE_BATCH)
    with torch.no_grad():
        parts = [model.features(x[i:i + batch_size]) for i in range(0, x.shape[0], batch_size)]
    if not parts:
        return torch.zeros(0, model.feature_dim, device=x.device)
    return torch.cat(parts).float()


@dataclass(frozen=True)
class StatsTask:
    """Client side of CCVR step 2: per-class (count, sum z, sum z z^T) of local features."""

    num_classes: int
    tukey: bool = False
    tukey_lambda: float = 0.5
    batch_size: int = 1024

    def compute(self, model: FeatureClassifier, x: Tensor, y: Tensor, bound: Bound) -> Payload:
        z = extract_features(model, x, self.batch_size)
        if self.tukey:
            z = relu_tukey(z, self.tukey_lambda)
        z = bound.clip(z, "feature")
        return ClassStats.from_features(z, y, self.num_classes).to_payload()


def virtual_counts(count: Tensor, per_class: int, mode: str = "balanced") -> Tensor:
    """Virtual features per class (long, (C,)); absent classes (count <= 0.5) get none."""
    present = count > 0.5
    if mode == "balanced":
        return torch.where(present, per_class, 0).long()
    if mode != "proportional":
        raise UsageError(f"virtual mode must be one of {', '.join(VIRTUAL_MODES)}, got {mode!r}")
    weights = torch.where(present, count.double().clamp_min(0), 0)
    if float(weights.sum()) <= 0:
        return torch.zeros_like(count, dtype=torch.long)
    total = per_class * count.shape[0]
    exact = weights / weights.sum() * total
    base = exact.floor().long()
    remainder = total - int(base.sum())
    # largest remainders first; ties go to the lower class index (stable sort)
    order = torch.sort(-(exact - base), stable=True).indices[:remainder]
    base[order] += 1
    return base


def sample_virtual_features(stats: ClassStats, per_class_counts: Tensor,
                            generator: torch.Generator, eig_floor: float = 1e-6,
                            abs_floor: float = 1e-8, dtype: torch.dtype = torch.float32
                            ) -> tuple[Tensor, Tensor]:
    """Draw ``per_class_counts[c]`` features from ``N(mu_c, Sigma_c)`` for every class.

    ``z = mu + V sqrt(L) eps`` with ``Sigma = V L V^T`` (float64 ``eigh``) and eigenvalues
    floored at ``eig_floor * max(lambda_max, 0) + abs_floor``. Classes with count < 2 get the
    mean repeated. Returns (z (M, d) in ``dtype``, y (M,) long), on the generator's device.
    """
    device = generator.device
    counts = per_class_counts.to(device=device, dtype=torch.long).clamp_min(0)
    counts = torch.where(stats.present.to(device), counts, 0)
    total = int(counts.sum())
    d = stats.dim
    y = torch.repeat_interleave(torch.arange(stats.num_classes, device=device), counts)
    if total == 0:
        return torch.zeros(0, d, dtype=dtype, device=device), y
    mean = stats.mean().to(device)
    cov = stats.covariance().to(device)
    classes = torch.nonzero(counts > 0).flatten()
    evals, evecs = torch.linalg.eigh(cov[classes])                    # batched over classes
    floor = eig_floor * evals[:, -1:].clamp_min(0) + abs_floor
    scale = evals.clamp_min(floor).sqrt()
    spread = stats.count.to(device)[classes] >= 2
    scale = torch.where(spread[:, None], scale, torch.zeros_like(scale))
    factors = evecs * scale[:, None, :]                               # V sqrt(L), (k, d, d)
    eps = torch.randn(total, d, generator=generator, device=device, dtype=torch.float64)
    z = torch.empty(total, d, dtype=torch.float64, device=device)
    sizes = counts[classes].tolist()
    start = 0
    for i, size in enumerate(sizes):          # one matmul per class, never per sample
        c = int(classes[i])
        z[start:start + size] = mean[c] + eps[start:start + size] @ factors[i].T
        start += size
    return z.to(dtype), y


#: the label of CCVR's release: its name in the transcript, the accountant and the reports
CCVR_RELEASE = "ccvr-stats"


@CALIBRATORS.register("ccvr")
class CCVR(PosthocCalibrator):
    """Post-hoc calibration on virtual features drawn from federated class Gaussians."""

    name: ClassVar[str] = "ccvr"
    Params: ClassVar[type] = CCVRParams
    arg_field: ClassVar[str] = "virtual_per_class"
    #: one release after training, from every client (docs/threat-model.md, sensitivities)
    releases: ClassVar[tuple[ReleaseSpec, ...]] = (ReleaseSpec(
        CCVR_RELEASE, sensitivity={"count": "1", "sum": "R", "outer": "R^2"},
        magnitude={"count": "N", "sum": "R*N", "outer": "R^2*N"}, participants="all",
        task=StatsTask, symmetric=frozenset({"outer"}),
        holds={"count": "per-class counts (C,)", "sum": "per-class feature sums (C, d)",
               "outer": "per-class sums of z z^T (C, d, d)"}),)

    def __init__(self, params: CCVRParams | None = None, *, num_classes: int,
                 feature_dim: int | None = None) -> None:
        super().__init__(params if params is not None else CCVRParams(),
                         num_classes=num_classes, feature_dim=feature_dim)
        self._transform: FeatureTransform | None = None

    def after_training(self, ctx: ServerContext) -> dict[str, Any]:
        p: CCVRParams = self.params
        t0 = time.perf_counter()
        task = StatsTask(self.num_classes, p.tukey, p.tukey_lambda, p.feature_batch_size)
        payload = ctx.collect(task, clients=list(range(ctx.num_clients)),
                              state=ctx.global_state, label=CCVR_RELEASE)
        stats = ClassStats.from_payload(payload, num_classes=self.num_classes,
                                        dim=self.feature_dim)
        counts = virtual_counts(stats.count.cpu(), p.virtual_per_class, p.virtual_mode)
        z, y = sample_virtual_features(stats, counts, ctx.generator, p.eig_floor)
        weight, bias = retrain_head_of(ctx.global_state, z.to(ctx.device), y.to(ctx.device),
                                       p, ctx.generator)
        return self._install(ctx, weight, bias, {
            "present_classes": int(stats.present.sum()),
            "virtual_features": int(z.shape[0]),
            "virtual_mode": p.virtual_mode,
            "tukey": p.tukey,
            "retrain_steps": p.num_steps(int(z.shape[0])),
            "seconds": round(time.perf_counter() - t0, 4),
        })

    def feature_transform(self) -> FeatureTransform | None:
        """ReLU + Tukey at inference, only once the head re-trained on transformed features
        is in place (the uncalibrated head was trained on raw features)."""
        if self.params.tukey and self._head is not None:
            # one object per calibrator: the simulator reuses an evaluation by identity
            if self._transform is None:
                self._transform = functools.partial(relu_tukey, lam=self.params.tukey_lambda)
            return self._transform
        return None


__all__ = ["CCVR", "CCVR_RELEASE", "CCVRParams", "StatsTask", "sample_virtual_features", "virtual_counts"]
