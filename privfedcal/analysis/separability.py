"""GMM separability: sliced Wasserstein distance between class Gaussians (CCVR sec. 5.4, fig. 6).

CCVR models each class's features as a Gaussian ``N(mu_c, Sigma_c)`` and reports the mean
sliced Wasserstein distance over all class pairs; the farther apart, the more calibration
can gain. The paper does not say which order or how many projections; our choice:

    SW2(P, Q) = sqrt( E_u [ W2^2(u.P, u.Q) ] ),   u uniform on the unit sphere,

estimated with ``n_projections`` random directions. Projections of Gaussians are
1-D Gaussians, so each ``W2`` is exact (no sampling of features):

    W2^2(u) = (u.mu1 - u.mu2)^2 + (sqrt(u^T S1 u) - sqrt(u^T S2 u))^2.

All class pairs share the same directions (common random numbers), so the whole
``C x C`` matrix costs one projection of every class. Computed in float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from privfedcal.errors import UsageError

__all__ = [
    "mean_sliced_wasserstein",
    "pairwise_sliced_wasserstein",
    "random_directions",
    "sliced_wasserstein_gaussians",
]

# Relative tolerance for round-off negative eigenvalues of a covariance estimate.
_PSD_RTOL = 1e-8


def random_directions(n: int, dim: int, generator: torch.Generator) -> Tensor:
    """``n`` directions drawn uniformly on the unit sphere of R^dim, ``(n, dim)`` float64."""
    if not isinstance(n, int) or n < 1:
        raise UsageError(f"n_projections must be a positive integer, got {n!r}")
    u = torch.randn(n, dim, generator=generator, dtype=torch.float64, device=generator.device)
    return u / torch.linalg.vector_norm(u, dim=1, keepdim=True)


def _check_gaussians(means: Tensor, covs: Tensor) -> tuple[Tensor, Tensor]:
    if (
        means.dim() != 2
        or covs.dim() != 3
        or covs.shape != (means.shape[0], means.shape[1], means.shape[1])
    ):
        raise UsageError(
            f"expected means (C, d) and covariances (C, d, d), got {tuple(means.shape)} and {tuple(covs.shape)}"
        )
    means = means.detach().to(torch.float64)
    covs = covs.detach().to(device=means.device, dtype=torch.float64)
    if not (torch.isfinite(means).all() and torch.isfinite(covs).all()):
        raise UsageError("Gaussian means/covariances contain NaN or Inf (a class no client holds?)")
    if not torch.allclose(covs, covs.transpose(1, 2), rtol=1e-6, atol=1e-10):
        raise UsageError("covariance matrices must be symmetric")
    eig = torch.linalg.eigvalsh(covs)
    scale = eig.abs().amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    if (eig.amin(dim=1) < -_PSD_RTOL * scale).any():
        raise UsageError("covariance matrices must be positive semi-definite")
    return means, covs


def _projected(means: Tensor, covs: Tensor, dirs: Tensor) -> tuple[Tensor, Tensor]:
    """Projected means ``u.mu_c`` and standard deviations ``sqrt(u^T S_c u)``, each ``(C, L)``."""
    m = means @ dirs.T
    var = torch.einsum("ld,cde,le->cl", dirs, covs, dirs)
    return m, var.clamp_min(0.0).sqrt()  # clamp: round-off below zero on PSD input


def pairwise_sliced_wasserstein(
    means: Tensor, covs: Tensor, n_projections: int, generator: torch.Generator
) -> Tensor:
    """Symmetric ``(C, C)`` matrix of SW2 between the Gaussians ``N(means[c], covs[c])``."""
    means, covs = _check_gaussians(means, covs)
    dirs = random_directions(n_projections, means.shape[1], generator).to(means.device)
    m, s = _projected(means, covs, dirs)
    w2sq = (m[:, None, :] - m[None, :, :]).square() + (s[:, None, :] - s[None, :, :]).square()
    return w2sq.mean(dim=2).sqrt()


def sliced_wasserstein_gaussians(
    mu1: Tensor,
    cov1: Tensor,
    mu2: Tensor,
    cov2: Tensor,
    n_projections: int,
    generator: torch.Generator,
) -> float:
    """SW2 between ``N(mu1, cov1)`` and ``N(mu2, cov2)`` over ``n_projections`` random directions."""
    if mu1.shape != mu2.shape or cov1.shape != cov2.shape:
        raise UsageError(
            f"the two Gaussians differ in shape: {tuple(mu1.shape)} vs {tuple(mu2.shape)}"
        )
    means = torch.stack(
        [mu1.detach().to(torch.float64), mu2.detach().to(device=mu1.device, dtype=torch.float64)]
    )
    covs = torch.stack(
        [
            cov1.detach().to(device=mu1.device, dtype=torch.float64),
            cov2.detach().to(device=mu1.device, dtype=torch.float64),
        ]
    )
    return float(pairwise_sliced_wasserstein(means, covs, n_projections, generator)[0, 1])


def mean_sliced_wasserstein(
    stats: Mapping[object, tuple[Tensor, Tensor]] | Sequence[tuple[Tensor, Tensor]],
    n_projections: int,
    generator: torch.Generator,
) -> float:
    """Mean SW2 over all pairs of class Gaussians, given per-class ``(mean, cov)``.

    ``stats`` is ``{class: (mean (d,), cov (d, d))}`` or a list of such pairs. Leave out
    classes no client holds: their statistics are undefined.
    """
    pairs = list(stats.values()) if isinstance(stats, Mapping) else list(stats)
    if len(pairs) < 2:
        raise UsageError(f"separability needs at least 2 classes, got {len(pairs)}")
    try:
        means = torch.stack([torch.as_tensor(mu, dtype=torch.float64) for mu, _ in pairs])
        covs = torch.stack([torch.as_tensor(cov, dtype=torch.float64) for _, cov in pairs])
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(f"stats must be (mean, cov) pairs of equal shapes: {exc}") from exc
    mat = pairwise_sliced_wasserstein(means, covs, n_projections, generator)
    upper = torch.triu_indices(mat.shape[0], mat.shape[0], offset=1, device=mat.device)
    return float(mat[upper[0], upper[1]].mean())
