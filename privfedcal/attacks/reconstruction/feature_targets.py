"""What a feature inversion targets: a raw feature, a class mean, or a class's statistics
(n, mu, Sigma) as CCVR uploads them, and how each is posed to the optimiser.

Statistics pin features down (docs/results/privacy.md): with ``D`` the n x d matrix of
centred features, ``D^T D = (n-1) Sigma`` and ``1^T D = 0``, so D is known up to a rotation
inside the (n-1)-dimensional space orthogonal to ``1``. For n = 2 there is no freedom left
but the order: ``z = mu +- sqrt(lambda/2) v`` (lambda, v: top eigenpair of Sigma). Hence
``class-stats`` either matches mean AND unbiased covariance of a batch of n images
(``direct``) or first recovers the features and inverts each (``features``; used
automatically for n <= 2, where it is exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from privfedcal.errors import UsageError

TARGET_KINDS = ("raw-feature", "class-mean", "class-stats")
STATS_MODES = ("auto", "direct", "features")


@dataclass(frozen=True, eq=False)
class FeatureTarget:
    """What the attacker inverts. Build with ``raw``, ``class_mean`` or ``class_stats``."""

    kind: str
    z: Tensor | None = None  # raw-feature: (d,) or (k, d) independent features
    mean: Tensor | None = None  # class-mean / class-stats: (d,)
    cov: Tensor | None = None  # class-stats: (d, d) unbiased covariance
    n: int = 1  # number of samples behind mean / stats
    batch: bool = False  # class-mean: n images whose mean feature matches (else one image)
    mode: str = "auto"  # class-stats: auto | direct | features

    def __post_init__(self) -> None:
        if self.kind not in TARGET_KINDS:
            raise UsageError(f"unknown target kind {self.kind!r}; valid: {', '.join(TARGET_KINDS)}")
        if self.n < 1:
            raise UsageError(f"a target needs n >= 1 samples, got {self.n}")
        if self.kind == "raw-feature":
            if self.z is None or self.z.dim() not in (1, 2):
                raise UsageError("raw-feature target needs z of shape (d,) or (k, d)")
        elif self.mean is None or self.mean.dim() != 1:
            raise UsageError(f"{self.kind} target needs a mean of shape (d,)")
        if self.kind == "class-stats" and self.mean is not None:  # a mean: checked above
            d = self.mean.shape[0]
            if self.cov is None or self.cov.shape != (d, d):
                raise UsageError(f"class-stats target needs cov of shape ({d}, {d})")
            if self.mode not in STATS_MODES:
                raise UsageError(
                    f"unknown stats mode {self.mode!r}; valid: {', '.join(STATS_MODES)}"
                )

    @classmethod
    def raw(cls, z: Tensor) -> FeatureTarget:
        return cls("raw-feature", z=z)

    @classmethod
    def class_mean(cls, mean: Tensor, n: int = 1, *, batch: bool = False) -> FeatureTarget:
        return cls("class-mean", mean=mean, n=n, batch=batch)

    @classmethod
    def class_stats(cls, n: int, mean: Tensor, cov: Tensor, *, mode: str = "auto") -> FeatureTarget:
        return cls("class-stats", mean=mean, cov=cov, n=n, mode=mode)


def features_from_stats(n: int, mean: Tensor, cov: Tensor) -> Tensor:
    """The n features implied by (n, mean, unbiased cov), as an (n, d) tensor.

    Exact (up to order) for n <= 2. For n > 2 the result has exactly the given mean and
    the best rank-(n-1) approximation of cov, built on a fixed Helmert contrast basis; the
    true set equals it only up to an unknown rotation of that basis, so individual features
    are not identified by the statistics alone.
    """
    if n < 1:
        raise UsageError(f"n must be >= 1, got {n}")
    mu = mean.double()
    if n == 1:
        return mu[None].to(mean.dtype)
    evals, evecs = torch.linalg.eigh(cov.double())
    k = min(n - 1, mu.shape[0])
    evals, evecs = evals.flip(0)[:k].clamp_min(0), evecs.flip(1)[:, :k]
    # Helmert basis: n x (n-1), orthonormal columns orthogonal to the all-ones vector.
    q = torch.zeros(n, n - 1, dtype=torch.float64, device=mu.device)
    for j in range(1, n):
        q[:j, j - 1] = 1.0 / math.sqrt(j * (j + 1))
        q[j, j - 1] = -j / math.sqrt(j * (j + 1))
    centred = q[:, :k] * torch.sqrt((n - 1) * evals) @ evecs.T
    return (mu + centred).to(mean.dtype)


@dataclass(frozen=True, eq=False)
class PosedTarget:
    """A target as the optimiser sees it: per-image feature targets (B, d), or a mean (d,)
    with, for ``class-stats-direct``, an unbiased covariance; ``batch`` images."""

    mode: str
    batch: int
    per_image: Tensor | None = None
    mu: Tensor | None = None
    cov: Tensor | None = None

    @property
    def term(self) -> str:
        """Targets with the same term can share one batched optimisation."""
        return "per-image" if self.per_image is not None else (
            "stats" if self.cov is not None else "mean")


def _required(field: Tensor | None, name: str) -> Tensor:
    """A field that ``FeatureTarget`` checks is set for the target's kind."""
    if field is None:
        raise UsageError(f"the target lacks its {name}")
    return field


def shape_of(target: FeatureTarget) -> tuple[str, int]:
    """``(term, images)``: the kind of loss term an inversion of ``target`` minimises
    (``per-image`` | ``mean`` | ``stats``; only targets with the same term share a batch)
    and how many images it optimises per restart (``pose`` decides the same way)."""
    if target.kind == "raw-feature":
        z = _required(target.z, "z")
        return "per-image", 1 if z.dim() == 1 else int(z.shape[0])
    if target.kind == "class-mean":
        return ("mean", target.n) if target.batch and target.n > 1 else ("per-image", 1)
    if target.mode == "features" or (target.mode == "auto" and target.n <= 2) or target.n == 1:
        return "per-image", target.n
    return "stats", target.n


def pose(target: FeatureTarget, device: torch.device, dtype: torch.dtype) -> PosedTarget:
    """``target`` as the optimiser is given it, on ``device`` in ``dtype``."""
    per_image: Tensor | None = None
    mu = cov = None
    if target.kind == "raw-feature":
        z = _required(target.z, "z")
        per_image, mode = z.reshape(-1, z.shape[-1]), "raw-feature"
    elif target.kind == "class-mean":
        if target.batch and target.n > 1:
            mu, mode = target.mean, "class-mean-batch"
        else:
            per_image, mode = _required(target.mean, "mean")[None], "class-mean"
    elif target.mode == "features" or (target.mode == "auto" and target.n <= 2) or target.n == 1:
        per_image = features_from_stats(target.n, _required(target.mean, "mean"),
                                        _required(target.cov, "cov"))
        mode = "class-stats-features"
    else:
        mu, cov, mode = target.mean, target.cov, "class-stats-direct"
    batch = per_image.shape[0] if per_image is not None else target.n
    return PosedTarget(mode, batch,
                       None if per_image is None else per_image.to(device, dtype),
                       None if mu is None else mu.to(device, dtype),
                       None if cov is None else cov.to(device, dtype))


__all__ = ["STATS_MODES", "TARGET_KINDS", "FeatureTarget", "PosedTarget", "features_from_stats",
           "pose", "shape_of"]
