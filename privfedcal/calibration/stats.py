"""Additive per-class feature statistics for CCVR (Luo et al., NeurIPS 2021, Eq. 3-4).

A client summarises its features of class c by the sums ``N_c`` (count), ``s_c = sum z`` and
``S_c = sum z z^T``. Unlike the paper's (N, mu, Sigma) upload these merge by plain addition,
which secure aggregation and DP noise need; the server recovers
``mu_c = s_c / N_c`` and the unbiased ``Sigma_c = (S_c - N_c mu_c mu_c^T) / (N_c - 1)``,
identical to the paper's Eq. 3-4 merge (``merge_client_moments``, kept to prove it in tests).

Conventions (ours where the paper is silent):

* everything is accumulated and stored in float64;
* a class is *present* when its count exceeds 0.5 (counts may be real-valued once DP noise
  has been added); absent classes have a zero mean;
* the covariance follows the formula for ``count >= 2``; for ``count < 2`` (one sample, no
  sample, or a noisy count below 2) it is the zero matrix, as in the paper's
  "Sigma = 0 if N = 1" rule;
* covariances are symmetrised (noise added to ``S`` need not be symmetric).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from privfedcal.errors import UploadRejected
from privfedcal.tensors import all_finite

#: a class counts as present above this (possibly noisy) count
PRESENT_THRESHOLD = 0.5
PAYLOAD_KEYS = ("count", "sum", "outer")


@dataclass(frozen=True, eq=False)
class ClassStats:
    """Per-class count (C,), feature sum (C, d) and sum of outer products (C, d, d), float64."""

    count: Tensor
    sum: Tensor
    outer: Tensor

    def __post_init__(self) -> None:
        c = self.count.shape[0] if self.count.dim() == 1 else -1
        d = self.sum.shape[1] if self.sum.dim() == 2 else -1
        if (c < 0 or d < 0 or self.sum.shape != (c, d) or self.outer.shape != (c, d, d)):
            raise ValueError(
                f"inconsistent ClassStats shapes: count {tuple(self.count.shape)}, "
                f"sum {tuple(self.sum.shape)}, outer {tuple(self.outer.shape)}")
        for name in PAYLOAD_KEYS:
            t = getattr(self, name)
            if t.dtype != torch.float64:
                object.__setattr__(self, name, t.to(torch.float64))

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def zeros(cls, num_classes: int, dim: int, device: torch.device | str | None = None
              ) -> ClassStats:
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        return cls(torch.zeros(num_classes, **f64), torch.zeros(num_classes, dim, **f64),
                   torch.zeros(num_classes, dim, dim, **f64))

    @classmethod
    def from_features(cls, z: Tensor, y: Tensor, num_classes: int) -> ClassStats:
        """Statistics of features ``z`` (n, d) with labels ``y`` (n,), accumulated in float64."""
        if z.dim() != 2 or y.shape != (z.shape[0],):
            raise ValueError(f"need z (n, d) and y (n,), got {tuple(z.shape)} and {tuple(y.shape)}")
        z = z.detach().to(torch.float64)
        y = y.to(device=z.device, dtype=torch.long)
        n, d = z.shape
        count = torch.zeros(num_classes, dtype=torch.float64, device=z.device)
        count.index_add_(0, y, torch.ones(n, dtype=torch.float64, device=z.device))
        total = torch.zeros(num_classes, d, dtype=torch.float64, device=z.device)
        total.index_add_(0, y, z)
        outer = torch.zeros(num_classes, d, d, dtype=torch.float64, device=z.device)
        # One (d, n_c) @ (n_c, d) product per class that occurs: n d^2 flops in total, where a
        # one-hot formulation costs C n d^2 flops (or C n d memory). The loop is over classes,
        # never over samples.
        order = torch.argsort(y, stable=True)
        sizes = torch.bincount(y, minlength=num_classes).tolist()
        for c, zc in zip(range(num_classes), torch.split(z[order], sizes), strict=True):
            if zc.shape[0]:
                outer[c] = zc.T @ zc
        return cls(count, total, outer)

    @classmethod
    def from_payload(cls, payload: dict[str, Tensor], *, num_classes: int | None = None,
                     dim: int | None = None) -> ClassStats:
        """Validate an (aggregated) upload; malformed input raises ``UploadRejected``."""
        if not isinstance(payload, dict) or set(payload) != set(PAYLOAD_KEYS):
            got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
            raise UploadRejected(f"class-statistics payload needs keys {list(PAYLOAD_KEYS)}, got {got}")
        for key in PAYLOAD_KEYS:
            t = payload[key]
            if not isinstance(t, Tensor) or not (t.is_floating_point() or t.dtype == torch.long):
                raise UploadRejected(f"class-statistics payload entry {key!r} is not a real tensor")
            if not all_finite(t):
                raise UploadRejected(f"class-statistics payload entry {key!r} has NaN/Inf values")
        count, total, outer = (payload[k] for k in PAYLOAD_KEYS)
        try:
            stats = cls(count, total, outer)
        except ValueError as exc:
            raise UploadRejected(str(exc)) from None
        if num_classes is not None and stats.num_classes != num_classes:
            raise UploadRejected(f"class-statistics payload has {stats.num_classes} classes, expected {num_classes}")
        if dim is not None and stats.dim != dim:
            raise UploadRejected(f"class-statistics payload has feature dim {stats.dim}, expected {dim}")
        return stats

    def to_payload(self) -> dict[str, Tensor]:
        return {"count": self.count, "sum": self.sum, "outer": self.outer}

    # ---- algebra --------------------------------------------------------------------------
    def __add__(self, other: ClassStats) -> ClassStats:
        if not isinstance(other, ClassStats):
            return NotImplemented
        if self.sum.shape != other.sum.shape:
            raise ValueError(f"cannot merge ClassStats of shapes {tuple(self.sum.shape)} and "
                             f"{tuple(other.sum.shape)}")
        return ClassStats(self.count + other.count, self.sum + other.sum, self.outer + other.outer)

    # ---- derived quantities ---------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return int(self.count.shape[0])

    @property
    def dim(self) -> int:
        return int(self.sum.shape[1])

    @property
    def present(self) -> Tensor:
        """Boolean (C,): classes with a count above 0.5."""
        return self.count > PRESENT_THRESHOLD

    def mean(self) -> Tensor:
        """(C, d) class means; zero rows for absent classes (never NaN)."""
        safe = torch.where(self.present, self.count, torch.ones_like(self.count))
        return torch.where(self.present[:, None], self.sum / safe[:, None],
                           torch.zeros_like(self.sum))

    def covariance(self) -> Tensor:
        """(C, d, d) unbiased class covariances; the zero matrix where count < 2."""
        n = self.count
        ok = n >= 2
        safe = torch.where(ok, n, torch.full_like(n, 2.0))
        centred = self.outer - self.sum[:, :, None] * self.sum[:, None, :] / safe[:, None, None]
        cov = centred / (safe - 1)[:, None, None]
        cov = 0.5 * (cov + cov.transpose(1, 2))
        return torch.where(ok[:, None, None], cov, torch.zeros_like(cov))


def merge_client_moments(counts: Tensor, means: Tensor, covs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The paper's merge of per-client (N_ck, mu_ck, Sigma_ck), Eq. 3-4.

    ``counts`` (K, C), ``means`` (K, C, d), ``covs`` (K, C, d, d) -> (N_c, mu_c, Sigma_c) with
    the conventions of ``ClassStats`` (zero mean for absent classes, zero covariance for
    N_c < 2). Clients without class c (N_ck = 0) contribute nothing whatever their mean.
    """
    counts, means, covs = (t.to(torch.float64) for t in (counts, means, covs))
    n_c = counts.sum(0)
    present = n_c > PRESENT_THRESHOLD
    safe_n = torch.where(present, n_c, torch.ones_like(n_c))
    mu = torch.einsum("kc,kcd->cd", counts, means) / safe_n[:, None]
    mu = torch.where(present[:, None], mu, torch.zeros_like(mu))
    ok = n_c >= 2
    denom = torch.where(ok, n_c - 1, torch.ones_like(n_c))
    w_cov = (counts - 1).clamp_min(0) / denom                     # (N_ck - 1) / (N_c - 1)
    w_mean = counts / denom                                       # N_ck / (N_c - 1)
    sigma = (torch.einsum("kc,kcde->cde", w_cov, covs)
             + torch.einsum("kc,kcd,kce->cde", w_mean, means, means)
             - (n_c / denom)[:, None, None] * mu[:, :, None] * mu[:, None, :])
    sigma = torch.where(ok[:, None, None], sigma, torch.zeros_like(sigma))
    return n_c, mu, sigma
