"""Sample-level differential privacy for calibration uploads: clipping and Gaussian noise.

Threat model: (epsilon, delta)-DP with respect to adding or removing ONE training example of
one client (sample level), for what the server sees of the calibration uploads. Every upload
is a dict of per-client SUMS over local samples plus counts (see ``federation/hooks.py``), so
its sensitivity follows from clipping each per-sample row to an L2 bound. Each calibrator
declares its keys' sensitivities in its release's ``ReleaseSpec`` (privacy/releases.py),
the one place they are written; for the built-in calibrators they are:

* CCVR statistics, features clipped to ``||z|| <= R``: removing one sample of class c changes
  ``count`` by 1 (one entry), ``sum`` by ``z`` (norm <= R) and ``outer`` by ``z z^T``, whose
  Frobenius norm is ``||z||^2 <= R^2``.
* CReFF class gradients, per-sample gradients clipped to ``||g|| <= G``: ``grad`` changes by
  ``g`` (norm <= G), ``count`` and ``holders`` (presence indicator) by at most 1. A
  per-class MEAN of clipped gradients also moves by <= G (``2G/n`` for n >= 2; g -> 0 for
  n = 1), so ``grad`` keeps sensitivity G in CReFF's presence-weighted mode.

Gaussian mechanism on a named payload (Dwork & Roth 2014, Thm A.1; Mironov 2017 for RDP):
dividing key k by its sensitivity ``s_k`` gives K keys that each move by <= 1, hence a joint
L2 sensitivity of ``sqrt(K)``; adding ``N(0, (z sqrt(K))^2)`` to the scaled payload and
scaling back means key k gets noise of std ``z * sqrt(K) * s_k``. The release is then a
Gaussian mechanism with noise multiplier ``z`` for the accountant (``accounting.py``).
More generally, with budget shares ``w_k`` (positive, summing to 1 over the keys with a
positive sensitivity; equal shares ``1/K`` above), dividing key k by ``s_k / sqrt(w_k)`` gives
a joint sensitivity of ``sqrt(sum w_k) = 1``, so key k gets std ``z * s_k / sqrt(w_k)`` for the
same multiplier ``z``: a key that needs little precision (CReFF's counts, used for a mask)
can give its share to the others (``ReleaseSpec.noise_share``).

The guarantee holds only if every per-sample quantity summed into the payload went through
``L2Clip.clip`` with the bound its key's sensitivity assumes, and only for what the payload
reveals: model updates leak too unless local training is DP-SGD (``dpsgd.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from privfedcal.errors import UsageError

# Kinds that payload tasks pass to ``Bound.clip(rows, kind)`` (calibration/ccvr.py, creff.py).
FEATURES = "feature"
GRADIENTS = "class-gradient"


def default_delta(num_examples: int) -> float:
    """The delta of a run without ``--dp-delta``: ``min(1e-5, 1/(10 N))`` with N the total
    number of training examples in the federation. Delta must stay well below 1/N, since a
    mechanism that publishes one random example outright is (0, 1/N)-DP."""
    if num_examples < 1:
        raise UsageError(f"cannot choose delta for {num_examples} training examples")
    return min(1e-5, 1.0 / (10 * num_examples))


@dataclass(frozen=True)
class L2Clip:
    """The ``Bound`` stage: each row (one sample, flattened) is scaled to L2 norm <= bound.

    ``bound`` is one float for every kind, or a mapping kind -> bound; with a mapping an
    unknown kind raises instead of silently clipping to a bound the sensitivities do not
    assume. Rows already inside the ball are returned unchanged (bit for bit).
    """

    bound: float | Mapping[str, float]

    def __post_init__(self) -> None:
        values = self.bound.values() if isinstance(self.bound, Mapping) else [self.bound]
        for v in values:
            if not (math.isfinite(v) and v > 0):
                raise UsageError(f"clipping bound must be a finite number > 0, got {v}")

    def bound_for(self, kind: str) -> float:
        if not isinstance(self.bound, Mapping):
            return float(self.bound)
        if kind not in self.bound:
            raise ValueError(f"no clipping bound for kind {kind!r}; known kinds: "
                             f"{', '.join(sorted(self.bound))}")
        return float(self.bound[kind])

    def clip(self, rows: Tensor, kind: str) -> Tensor:
        bound = self.bound_for(kind)
        if rows.ndim == 0:
            raise ValueError("L2Clip.clip expects rows of shape (n, ...), got a scalar")
        norms = rows.reshape(rows.shape[0], -1).norm(dim=1)
        # min(1, R/||row||) computed without dividing by zero; exactly 1 inside the ball.
        scale = torch.where(norms > bound, bound / norms.clamp_min(1e-30), torch.ones_like(norms))
        return rows * scale.reshape((-1,) + (1,) * (rows.ndim - 1)).to(rows.dtype)


def noise_stds(sensitivities: Mapping[str, float], noise_multiplier: float,
               share: float = 1.0, budget: Mapping[str, float] | None = None) -> dict[str, float]:
    """Std of the Gaussian noise per key: ``z * s_k / sqrt(w_k) * sqrt(share)`` with ``w_k``
    the key's share of the budget: ``budget[k]`` normalised over the keys with a positive
    sensitivity, or ``1/K`` for each of those K keys without ``budget`` (then the std is
    ``z * sqrt(K) * s_k * sqrt(share)``). Keys with sensitivity 0 are data-independent."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
    if not 0 < share <= 1:
        raise ValueError(f"noise share must be in (0, 1], got {share}")
    for k, s in sensitivities.items():
        if not (math.isfinite(s) and s >= 0):
            raise ValueError(f"sensitivity of {k!r} must be finite and >= 0, got {s}")
    live = [k for k, s in sensitivities.items() if s > 0]
    weights = {k: 1.0 for k in live} if budget is None else {k: budget.get(k, 0.0) for k in live}
    if any(not (math.isfinite(w) and w > 0) for w in weights.values()):
        raise ValueError(f"every noised key needs a positive finite budget share, got {weights}")
    total = sum(weights.values())
    return {k: noise_multiplier * s * math.sqrt(share * total / weights[k]) if s > 0 else 0.0
            for k, s in sensitivities.items()}


def gaussian_mechanism(payload: Mapping[str, Tensor], sensitivities: Mapping[str, float],
                       noise_multiplier: float, generator: torch.Generator,
                       share: float = 1.0, budget: Mapping[str, float] | None = None
                       ) -> dict[str, Tensor]:
    """Add Gaussian noise to every key of ``payload`` (see module docstring for the scale).

    ``share`` scales the variance: with distributed DP each of n clients passes ``1/n`` so the
    securely aggregated sum carries the full variance; ``budget`` splits the noise budget
    between the keys (``noise_stds``). Every payload key needs an entry in
    ``sensitivities`` (extra entries are ignored); a missing one raises, so nothing is ever
    released without noise by accident. Integer tensors (counts) come back as floats of the
    default dtype. Noise is drawn on ``generator``'s device, then moved to the tensor's.
    """
    missing = [k for k in payload if k not in sensitivities]
    if missing:
        raise UsageError(f"payload keys {missing} have no sensitivity; refusing to release "
                         "them without noise")
    stds = noise_stds({k: sensitivities[k] for k in payload}, noise_multiplier, share, budget)
    out = {}
    for k, t in payload.items():
        dtype = t.dtype if t.is_floating_point() else torch.get_default_dtype()
        noise = torch.randn(t.shape, generator=generator, device=generator.device, dtype=dtype)
        out[k] = t.to(dtype) + stds[k] * noise.to(t.device)
    return out


def project_psd(cov: Tensor, floor: float = 0.0) -> Tensor:
    """Nearest (Frobenius) symmetric matrix with eigenvalues >= ``floor``, batched (..., d, d).

    Noisy covariances are indefinite; sampling virtual features needs them PSD. Symmetrise,
    eigendecompose, clamp the spectrum. Computed in float64, returned in ``cov``'s dtype.
    """
    if cov.ndim < 2 or cov.shape[-1] != cov.shape[-2]:
        raise ValueError(f"project_psd expects (..., d, d), got {tuple(cov.shape)}")
    c = cov.to(torch.float64)
    c = 0.5 * (c + c.transpose(-1, -2))
    vals, vecs = torch.linalg.eigh(c)
    vals = vals.clamp_min(floor)
    out = (vecs * vals.unsqueeze(-2)) @ vecs.transpose(-1, -2)
    return (0.5 * (out + out.transpose(-1, -2))).to(cov.dtype)


def noisy_stats_to_moments(count: Tensor, total: Tensor, outer: Tensor, *, min_count: float = 2.0,
                           floor: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Per-class (count, mean, covariance) from noisy sums ``count (C,), sum (C,d),
    outer (C,d,d)``, in float64.

    ``n = max(count, min_count)`` keeps the ratios finite; ``mean = sum / n`` and
    ``cov = project_psd((outer - n mean mean^T) / (n - 1))``. Biases: the mean and covariance
    are ratios of noisy quantities (biased, consistent as counts grow); clamping moves small
    counts up; the PSD projection only raises eigenvalues. The returned count is
    ``max(count, 0)``. Classes with a true count near zero come back as noise: callers should
    skip classes whose count is small relative to the count noise std.
    """
    if min_count <= 1:
        raise ValueError("min_count must be > 1 (the covariance divides by n - 1)")
    n = count.to(torch.float64).clamp_min(min_count)
    mean = total.to(torch.float64) / n.unsqueeze(-1)
    second = outer.to(torch.float64) - n[:, None, None] * mean.unsqueeze(-1) * mean.unsqueeze(-2)
    cov = project_psd(second / (n - 1)[:, None, None], floor)
    return count.to(torch.float64).clamp_min(0), mean, cov
