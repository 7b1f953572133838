"""Class-gradient inversion: features and labels from a linear classifier's gradient.

Analytic recovery from a linear classifier's gradient (Phong et al. 2017; iDLG, Zhao
et al. 2020; docs/privacy/attacks.md). For one sample with features z and label y under
cross-entropy, ``dL/dW_j = (p_j - y_j) z^T`` and ``dL/db_j = p_j - y_j``: every row with a
non-zero bias gradient gives ``z = dW_j / db_j`` exactly, and the label is the only
negative bias entry. For the mean gradient of n samples of one class c (a CReFF upload
row block), row j gives ``sum_i w_ij z_i`` with ``w_ij = (p_ij - y_ij) / sum_i (p_ij - y_ij)``:
for j = c the weights are ``(1 - p_ic) / sum_i (1 - p_ic)`` (positive, summing to 1), for
j != c they are ``p_ij / sum_i p_ij``. So every row is a convex combination of the z_i,
weighted toward the samples the model gets wrong. We combine all rows by least squares,
``z = argmin sum_j ||dW_j - db_j z||^2 = sum_j db_j dW_j / sum_j db_j^2``, which is exact
for one sample and weights rows by ``db_j^2`` (row c, the largest, dominates). The relative
residual of that rank-one fit tells one sample (0) from several.

Rank-n recovery (``recover_rank_n``) solves for the n features behind one class gradient
given the head the client used; ``recover_rank_n_rounds`` does so from several rounds'
releases of the same features. Optimising images against class gradients of several
rounds is ``rounds.py``; inverting model updates (Geiping et al. 2020) is
``model_updates.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.attacks.reconstruction.feature_inversion import (
    Convergence,
    FeatureTarget,
    InversionConfig,
    InversionResult,
    invert_features,
)
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier


@dataclass(frozen=True, eq=False)
class LabelInfo:
    """What a class gradient says about labels and how many samples produced it."""

    label: Tensor  # (...,) index of the most negative bias entry (the label of one sample)
    negative: Tensor  # (..., C) bool: entries with negative bias gradient
    residual: Tensor  # (...,) ||dW - db z^T||_F / ||dW||_F of the least-squares fit
    single_sample: Tensor  # (...,) bool: exactly one negative entry and residual < tol


@dataclass(frozen=True, eq=False)
class GradientInversionResult:
    images: Tensor  # (B, C, H, W) pixel space [0, 1]
    labels: Tensor  # (B,) labels used (recovered or given)
    gradient_cosine: float  # cosine between the images' gradient and the observed one
    loss: float  # final objective (1 - cos + TV) of the kept restart
    restart_losses: Tensor  # (R,)
    convergence: Convergence | None = None


def split_class_gradient(grad: Tensor) -> tuple[Tensor, Tensor]:
    """A CReFF-style (..., C, d+1) gradient -> weight part (..., C, d) and bias (..., C)."""
    return grad[..., :-1], grad[..., -1]


def recover_from_class_gradient(
    grad_w: Tensor, grad_b: Tensor, *, tol: float = 1e-4
) -> tuple[Tensor, LabelInfo]:
    """Features behind a linear classifier's gradient, batched over leading dims.

    ``grad_w`` (..., C, d), ``grad_b`` (..., C) -> features (..., d) and ``LabelInfo``.
    Exact for a single sample; for a class-mean gradient a weighted mean of the samples'
    features (see module docstring). All-zero gradients give zero features.
    """
    if grad_w.shape[:-1] != grad_b.shape:
        raise UsageError(f"grad_w {tuple(grad_w.shape)} and grad_b {tuple(grad_b.shape)} disagree")
    gw, gb = grad_w.double(), grad_b.double()
    denom = gb.pow(2).sum(-1, keepdim=True)
    z = (gb.unsqueeze(-1) * gw).sum(-2) / denom.clamp_min(1e-300)
    fit = gw - gb.unsqueeze(-1) * z.unsqueeze(-2)
    residual = fit.flatten(-2).norm(dim=-1) / gw.flatten(-2).norm(dim=-1).clamp_min(1e-300)
    negative = gb < 0
    info = LabelInfo(
        label=gb.argmin(-1),
        negative=negative,
        residual=residual.float(),
        single_sample=(negative.sum(-1) == 1) & (residual < tol),
    )
    return z.to(grad_w.dtype), info


def invert_class_gradient(
    model: FeatureClassifier,
    grad_w: Tensor,
    grad_b: Tensor,
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    config: InversionConfig | None = None,
) -> InversionResult:
    """Analytic feature recovery, then raw-feature inversion to images (one per gradient)."""
    z, _ = recover_from_class_gradient(grad_w, grad_b)
    return invert_features(
        model,
        FeatureTarget.raw(z.reshape(-1, z.shape[-1])),
        image_shape=image_shape,
        mean=mean,
        std=std,
        generator=generator,
        config=config,
    )


def labels_from_bias_gradient(
    grad_b: Tensor, batch_size: int, *, use_magnitudes: bool = True
) -> Tensor:
    """Labels of a batch from the last-layer bias gradient of the mean CE loss (iDLG).

    ``-B db_j = n_j - sum_i p_ij``, so every class with ``db_j < 0`` is present and
    ``ceil(-B db_j)`` lower-bounds its count. Our heuristic for B > 1: start from those
    bounds (at least one per negative class, the most negative first if there are more
    than B), then fill the remaining slots round-robin from the most negative class.
    ``use_magnitudes=False`` (for model updates, whose scale is unknown) starts from one
    per negative class. Exact for B = 1. Returns sorted labels (B,).
    """
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    gb = grad_b.detach().double().reshape(-1)
    order = torch.argsort(gb)
    neg = order[gb[order] < 0][:batch_size]
    if neg.numel() == 0:
        neg = order[:1]
    counts = torch.zeros_like(gb, dtype=torch.long)
    if use_magnitudes:
        counts[neg] = torch.ceil(-batch_size * gb[neg] - 1e-9).clamp_min(1).long()
    else:
        counts[neg] = 1
    while int(counts.sum()) > batch_size:  # trim the largest
        counts[int(counts.argmax())] -= 1
    i = 0
    while int(counts.sum()) < batch_size:
        counts[neg[i % neg.numel()]] += 1
        i += 1
    return torch.repeat_interleave(
        torch.arange(gb.numel(), device=grad_b.device), counts.to(grad_b.device)
    )


@dataclass(frozen=True, eq=False)
class RankNResult:
    """Features recovered from one class gradient of n samples (``recover_rank_n``)."""

    features: Tensor  # (n, d), order arbitrary
    residual: float  # relative misfit of the class gradient they reproduce
    rank: int  # numerical rank of the weight gradient (n when n <= C - 1)


def gradient_rank(grad_w: Tensor, *, rtol: float = 1e-6) -> int:
    """Numerical rank of a (C, d) weight gradient: at most min(n, C - 1) for n samples."""
    s = torch.linalg.svdvals(grad_w.double())
    return int((s > rtol * s[0].clamp_min(1e-300)).sum()) if s.numel() else 0


def _head_gradient(z: Tensor, weight: Tensor, bias: Tensor | None, label: int) -> Tensor:
    """(C, d+1): the mean over the rows of ``z`` of the CE gradient w.r.t. ``[W | b]``,
    every sample labelled ``label`` (what a CReFF client uploads for one class)."""
    logits = z @ weight.T + (0 if bias is None else bias)
    r = torch.softmax(logits, dim=-1) - F.one_hot(torch.tensor(label), weight.shape[0]).to(z)
    ones = torch.ones_like(z[:, :1])
    return r.T @ torch.cat([z, ones], dim=1) / z.shape[0]


def recover_rank_n(
    grad: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    label: int,
    n: int,
    *,
    generator: torch.Generator,
    restarts: int = 16,
    max_iter: int = 500,
    stop: float = 1e-7,
) -> RankNResult:
    """The n features behind one class gradient ``grad`` (C, d+1) = [dW | db] of the mean CE
    loss of n samples of class ``label`` under the head (``weight`` (C, d), ``bias``).

    ``dW = (1/n) R^T Z`` with ``R`` the n x C residuals ``softmax(W z_i + b) - e_label``, so
    for n <= C - 1 (R of full rank) the rows of Z span the row space of dW: ``Z = A V^T``
    with V the top-n right singular vectors of dW and A an unknown n x n matrix. The
    attack solves the n^2 unknowns of A so that the head gradient of Z reproduces [dW | db]
    (L-BFGS in double precision from up to ``restarts`` starts, stopping at a relative
    residual below ``stop``; the best fit is kept).
    Exact up to the order of the samples when the fit residual is ~0: n = 1 gives
    ``dW_j / db_j``, n = 2 is pinned by a test. Needs the head the client used.
    """
    return recover_rank_n_rounds([grad], [(weight, bias)], label, n, generator=generator,
                                 restarts=restarts, max_iter=max_iter, stop=stop)


def _rounds_in_double(grads: Sequence[Tensor], heads: Sequence[tuple[Tensor, Tensor | None]],
                      n: int) -> tuple[list[Tensor], list[tuple[Tensor, Tensor | None]]]:
    """The releases' gradients and heads in float64 on the gradients' device, checked:
    one head per gradient, n >= 1."""
    if n < 1:
        raise UsageError(f"rank-n recovery needs n >= 1, got {n}")
    if not grads or len(grads) != len(heads):
        raise UsageError(f"need one head per class gradient, got {len(grads)} gradients and "
                         f"{len(heads)} heads")
    gs = [g.detach().double() for g in grads]
    dev = gs[0].device
    return gs, [(w.detach().double().to(dev),
                 None if b is None else b.detach().double().to(dev)) for w, b in heads]


def _fit_coefficients(init: Tensor, v: Tensor, misfit: Callable[[Tensor], Tensor],
                      max_iter: int) -> tuple[float, Tensor]:
    """L-BFGS on the coefficients A (n x k) of ``Z = A V^T`` from ``init``: (relative
    residual ``sqrt(misfit)``, Z) at the end."""
    a = init.requires_grad_(True)
    opt = torch.optim.LBFGS([a], lr=1, max_iter=max_iter, tolerance_grad=1e-14,
                            tolerance_change=1e-16, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = misfit(a @ v.T)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        z = a.detach() @ v.T
        return float(misfit(z).sqrt()), z


def recover_rank_n_rounds(
    grads: Sequence[Tensor],
    heads: Sequence[tuple[Tensor, Tensor | None]],
    label: int,
    n: int,
    *,
    generator: torch.Generator,
    restarts: int = 16,
    max_iter: int = 500,
    stop: float = 1e-7,
) -> RankNResult:
    """``recover_rank_n`` from several releases of the SAME n features under different
    heads: CReFF class gradients of one client's class from several rounds, each with the
    head the server sent that round (``Release.task``), while the features are unchanged
    (the extractor is fixed between those releases and the client draws the same samples;
    for a changing extractor see ``invert_class_gradients``).

    One release has rank at most min(n, C - 1): with n > C - 1 the features have a component
    its gradient's row space does not show. Every release adds C (d + 1) equations and its
    own row space, so the stacked weight gradients ``[dW_1; dW_2; ...]`` span the rows of Z
    once their ranks add up to n: ``Z = A V^T`` with V the top right singular vectors of
    the stack, and A (n x k) is fitted to all releases at once (relative residual
    ``sqrt(sum_r ||G_r(Z) - g_r||^2 / sum_r ||g_r||^2)``). ``rank`` is that of the stack.
    """
    gs, hs = _rounds_in_double(grads, heads, n)
    dev = gs[0].device
    stack = torch.cat([g[:, :-1] for g in gs])
    rank = gradient_rank(stack)
    _, s, vh = torch.linalg.svd(stack, full_matrices=False)
    k = min(n, vh.shape[0])
    v = vh[:k].T  # (d, k)
    scale2 = cast(Tensor, sum(g.pow(2).sum() for g in gs)).clamp_min(1e-300)  # gs non-empty
    # start: the least-squares weighted-mean feature of the first release, repeated
    z_ls, _ = recover_from_class_gradient(gs[0][:, :-1], gs[0][:, -1])

    def misfit(z: Tensor) -> Tensor:
        return sum((_head_gradient(z, w, b, label) - g).pow(2).sum()
                   for g, (w, b) in zip(gs, hs, strict=True)) / scale2

    # starts spread around the weighted mean by the stack's spectrum (restart 0: the mean)
    spread = (s[:k].sum() / s[0].clamp_min(1e-300)).item()
    best: tuple[float, Tensor] | None = None
    for r in range(restarts):
        init = (z_ls @ v).expand(n, k).clone()
        if r:
            noise = torch.randn(n, k, generator=generator, dtype=torch.float64)
            init = init + noise.to(dev) * init.norm() * 0.5 * spread / max(k, 1) ** 0.5
        res, z = _fit_coefficients(init, v, misfit, max_iter)
        if best is None or res < best[0]:
            best = (res, z)
        if res < stop:
            break
    assert best is not None
    return RankNResult(best[1].to(grads[0].dtype), best[0], rank)
