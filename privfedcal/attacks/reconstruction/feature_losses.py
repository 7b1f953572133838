"""The terms of the feature-inversion objective and its convergence measure.

Data terms compare the features of candidate images with the target: ``raw_loss`` per image
(1 - cos plus the squared error relative to the target's size), ``stats_loss`` a batch's
mean and unbiased covariance against a class's (mu, Sigma). ``BNPrior`` is DeepInversion's
BatchNorm prior (Yin et al. 2020: the batch mean/variance of every BN input matched to its
running statistics). ``relative_feature_error`` is the measure the optimiser's convergence
test reads (``engine.InversionConfig``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BNPrior:
    """Forward hooks that record, per restart group of ``per_group`` images, how far BN
    input statistics are from the running statistics (DeepInversion's R_feature, L2
    norms). ``group_ids`` (N,), when set, names the group of each input image instead
    (groups of different sizes: a batch of targets without its padding)."""

    def __init__(self, model: nn.Module, per_group: int) -> None:
        self.per_group, self.loss = per_group, None
        self.group_ids: Tensor | None = None
        self.groups = 0
        self.handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
        ]

    def _hook(self, module: nn.modules.batchnorm._BatchNorm, inputs: tuple[Tensor, ...],
              _out: Tensor) -> None:
        running_mean, running_var = module.running_mean, module.running_var
        if running_mean is None or running_var is None:
            return  # hooked only on layers that keep running statistics
        x = inputs[0]
        if self.group_ids is None:
            groups = x.shape[0] // self.per_group
            h = x.reshape(groups, self.per_group, x.shape[1], -1).transpose(1, 2).flatten(2)
            if h.shape[-1] < 2:
                return  # one value per channel: no batch statistics to match
            mean, var = h.mean(-1), h.var(-1, unbiased=False)
            enough = None
        else:  # the same two-pass statistics, summed per group with index_add
            ids, h = self.group_ids, x.flatten(2)  # (N, C, S)
            count = h.new_zeros(self.groups).index_add_(
                0, ids, h.new_ones(h.shape[0])) * h.shape[-1]
            mean = h.new_zeros(self.groups, h.shape[1]).index_add_(0, ids, h.sum(-1))
            mean = mean / count[:, None]
            dev = (h - mean[ids][..., None]).pow(2).sum(-1)
            var = h.new_zeros(self.groups, h.shape[1]).index_add_(0, ids, dev) / count[:, None]
            enough = (count >= 2).to(h.dtype)  # as above: a single value adds nothing
        term = (mean - running_mean).norm(dim=-1) + (var - running_var).norm(dim=-1)
        term = term if enough is None else term * enough
        self.loss = term if self.loss is None else self.loss + term

    def pop(self) -> Tensor | None:
        loss, self.loss = self.loss, None
        return loss

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def masked_mean(z: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Mean over the image dim -2 of (..., B, d) features, and the valid-image weights
    (..., B, 1) (None: every image counts)."""
    if valid is None:
        return z.mean(-2), None
    w = valid[..., None].to(z.dtype)
    return (z * w).sum(-2) / w.sum(-2), w


def relative_feature_error(
    z: Tensor, *, per_image: Tensor | None = None, mu: Tensor | None = None,
    cov: Tensor | None = None, valid: Tensor | None = None,
) -> Tensor:
    """Relative feature error per restart of (..., R, B, d) features, the convergence
    measure: per-image targets (..., B, d) ``max_i ||z_i - t_i|| / ||t_i||``; a mean
    ``||mean_i z_i - mu|| / ||mu||``; mean and covariance the larger of that and
    ``||Sigma_hat - Sigma||_F / ||Sigma||_F``. Leading target dims broadcast against
    ``mu`` (..., 1, d) / ``cov`` (..., 1, d, d); ``valid`` (..., 1, B) masks padding."""
    def rel(a: Tensor, b: Tensor) -> Tensor:
        return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)

    if per_image is not None:
        err = rel(z, per_image.expand_as(z))
        return (err if valid is None else err.masked_fill(~valid, -math.inf)).amax(-1)
    if mu is None:
        raise ValueError("relative_feature_error needs per-image targets or a mean")
    m, w = masked_mean(z, valid)
    err = rel(m, mu.expand_as(m))
    if cov is None:
        return err
    centred = z - m[..., None, :]
    if w is None:
        sigma = centred.transpose(-1, -2) @ centred / max(z.shape[-2] - 1, 1)
    else:
        centred = centred * w
        sigma = centred.transpose(-1, -2) @ centred / (w.sum(-2)[..., None] - 1).clamp_min(1)
    cerr = (sigma - cov).flatten(-2).norm(dim=-1) / cov.flatten(-2).norm(dim=-1).clamp_min(1e-12)
    return torch.maximum(err, cerr)


def raw_loss(z: Tensor, target: Tensor, valid: Tensor | None = None) -> Tensor:
    """(..., R, B, d) vs (..., B, d): mean over B of (1 - cos) + squared error relative to
    ||target||^2 (over the ``valid`` (..., 1, B) images only, when given)."""
    cos = F.cosine_similarity(z, target.expand_as(z), dim=-1)
    rel = (z - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-12)
    if valid is None:
        return (1 - cos + rel).mean(-1)
    w = valid.to(z.dtype)
    return ((1 - cos + rel) * w).sum(-1) / w.sum(-1)


def stats_loss(z: Tensor, mu: Tensor, cov: Tensor, valid: Tensor | None = None) -> Tensor:
    """(..., R, n, d) features vs (mu (..., 1, d), unbiased cov (..., 1, d, d)), each term
    scaled by its target's size; ``valid`` (..., 1, n) masks padding images."""
    m, w = masked_mean(z, valid)
    centred = z - m[..., None, :]
    if w is None:
        sigma = centred.transpose(-1, -2) @ centred / (z.shape[-2] - 1)
    else:
        centred = centred * w
        sigma = centred.transpose(-1, -2) @ centred / (w.sum(-2)[..., None] - 1)
    trace = cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    mean_term = (m - mu).pow(2).sum(-1) / (mu.pow(2).sum(-1) + trace).clamp_min(1e-12)
    cov_term = (sigma - cov).pow(2).sum((-2, -1)) / cov.pow(2).sum((-2, -1)).clamp_min(1e-12)
    return mean_term + cov_term + (1 - F.cosine_similarity(m, mu.expand_as(m), dim=-1))


__all__ = ["BNPrior", "masked_mean", "raw_loss", "relative_feature_error", "stats_loss"]
