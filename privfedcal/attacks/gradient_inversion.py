"""Gradient inversion: features and images from classifier gradients and model updates.

(a) Analytic recovery from a linear classifier's gradient (Phong et al. 2017; iDLG, Zhao
et al. 2020; docs/privacy-audit.md). For one sample with features z and label y under
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

(b) Optimisation-based inversion of a client's gradient or model update (Geiping et al.
2020, "Inverting Gradients"): images are optimised so that the parameter gradient they
produce has cosine similarity 1 with the observed one (over all parameters at once), with a
TV prior, box constraint and restarts. Labels come first from the last-layer bias gradient
(iDLG). A model update after several local SGD steps is treated as ``-lr * gradient``
(exact for one full-batch step; an approximation otherwise, best for few steps and small
lr); since the cosine ignores scale, lr need not be known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.attacks.feature_inversion import (
    DEFAULT_MAX_STEPS,
    Convergence,
    FeatureTarget,
    InversionConfig,
    InversionResult,
    invert_features,
    optimise_images,
    to_pixels,
)
from privfedcal.attacks.modes import eval_mode
from privfedcal.errors import UsageError
from privfedcal.models.base import FeatureClassifier


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


def _target_gradients(
    model: FeatureClassifier, target: Mapping[str, Tensor], kind: str
) -> tuple[list[str], list[Tensor]]:
    if kind not in ("gradient", "update"):
        raise UsageError(f"kind must be 'gradient' or 'update', got {kind!r}")
    params = dict(model.named_parameters())
    names = [n for n in params if n in target and params[n].requires_grad]
    if not names:
        raise UsageError("the observed gradient/update names none of the model's parameters")
    sign = -1.0 if kind == "update" else 1.0  # update = new - old ~ -lr * gradient
    return names, [sign * target[n].detach().to(params[n]) for n in names]


def _bias_name(model: FeatureClassifier) -> str:
    for name, p in model.named_parameters():
        if p is model.classifier.bias:
            return name
    raise UsageError("label recovery needs a classifier with a bias; pass labels=")


def invert_update(
    model: FeatureClassifier,
    observed: Mapping[str, Tensor],
    *,
    batch_size: int,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    kind: str = "gradient",
    labels: Tensor | None = None,
    steps: int = DEFAULT_MAX_STEPS,
    lr: float = 0.1,
    tv: float = 1e-2,
    restarts: int = 2,
) -> GradientInversionResult:
    """Images whose CE gradient matches ``observed`` in cosine (Geiping et al. 2020).

    ``observed`` maps parameter names (``model.named_parameters()``) to the client's
    gradient (``kind="gradient"``) or model update ``new - old`` (``kind="update"``);
    buffers and unknown names are ignored. The model holds the state the client started
    from and runs in eval mode (BatchNorm uses running statistics, not the client's batch
    statistics). Labels, when not given, come from the bias entry's signs (and, for a
    gradient, magnitudes; an update's scale is unknown). Small local batches only: the
    attack degrades fast with B.
    """
    cfg = InversionConfig(
        steps=steps, lr=lr, restarts=restarts, tv_weight=tv, l2_weight=0.0, jitter=0, bn_weight=0.0
    )
    names, targets = _target_gradients(model, observed, kind)
    if labels is None:
        b_name = _bias_name(model)
        bias = observed[b_name] * (-1.0 if kind == "update" else 1.0)
        labels = labels_from_bias_gradient(bias, batch_size, use_magnitudes=kind == "gradient")
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    if labels.numel() != batch_size:
        raise UsageError(f"need {batch_size} labels, got {labels.numel()}")
    params = dict(model.named_parameters())
    plist = [params[n] for n in names]
    device = plist[0].device
    labels = labels.to(device)
    t_flat = torch.cat([t.flatten() for t in targets])
    t_norm = t_flat.norm().clamp_min(1e-12)

    def objective(x: Tensor) -> Tensor:
        losses = []
        for xr in x.split(batch_size):  # one parameter gradient per restart
            ce = F.cross_entropy(model(xr), labels)
            grads = torch.autograd.grad(ce, plist, create_graph=True)
            g = torch.cat([gi.flatten() for gi in grads])
            losses.append(1 - (g @ t_flat) / (g.norm().clamp_min(1e-12) * t_norm))
        return torch.stack(losses)

    def error(x: Tensor) -> Tensor:
        # relative error between unit-normalised gradients: sqrt(2 (1 - cos))
        with torch.enable_grad():
            return torch.sqrt(2 * objective(x).clamp_min(0)).detach()

    with eval_mode(model):
        x, final, best, conv = optimise_images(
            objective,
            restarts=cfg.restarts,
            batch=batch_size,
            image_shape=image_shape,
            mean=mean,
            std=std,
            config=cfg,
            generator=generator,
            device=device,
            dtype=plist[0].dtype,
            error=error,
        )
        with torch.enable_grad():
            cos = 1 - float(objective(x).detach()[0])
    return GradientInversionResult(
        images=to_pixels(x, mean, std),
        labels=labels,
        gradient_cosine=cos,
        loss=float(final[best]),
        restart_losses=final,
        convergence=conv,
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
    if n < 1:
        raise UsageError(f"rank-n recovery needs n >= 1, got {n}")
    if not grads or len(grads) != len(heads):
        raise UsageError(f"need one head per class gradient, got {len(grads)} gradients and "
                         f"{len(heads)} heads")
    gs = [g.detach().double() for g in grads]
    dev = gs[0].device
    hs = [(w.detach().double().to(dev), None if b is None else b.detach().double().to(dev))
          for w, b in heads]
    stack = torch.cat([g[:, :-1] for g in gs])
    rank = gradient_rank(stack)
    _, s, vh = torch.linalg.svd(stack, full_matrices=False)
    k = min(n, vh.shape[0])
    v = vh[:k].T  # (d, k)
    scale2 = sum(g.pow(2).sum() for g in gs).clamp_min(1e-300)
    # start: the least-squares weighted-mean feature of the first release, repeated
    z_ls, _ = recover_from_class_gradient(gs[0][:, :-1], gs[0][:, -1])

    def misfit(z: Tensor) -> Tensor:
        return sum((_head_gradient(z, w, b, label) - g).pow(2).sum()
                   for g, (w, b) in zip(gs, hs, strict=True)) / scale2

    best: tuple[float, Tensor] | None = None
    for r in range(restarts):
        init = (z_ls @ v).expand(n, k).clone()
        if r:  # spread the starts around the weighted mean
            spread = (s[:k].sum() / s[0].clamp_min(1e-300)).item()
            noise = torch.randn(n, k, generator=generator, dtype=torch.float64)
            init = init + noise.to(dev) * init.norm() * 0.5 * spread / max(k, 1) ** 0.5
        a = init.requires_grad_(True)
        opt = torch.optim.LBFGS([a], lr=1, max_iter=max_iter, tolerance_grad=1e-14,
                                tolerance_change=1e-16, history_size=50,
                                line_search_fn="strong_wolfe")

        def closure(a: Tensor = a, opt: torch.optim.LBFGS = opt) -> Tensor:
            opt.zero_grad()
            loss = misfit(a @ v.T)
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        with torch.no_grad():
            z = a.detach() @ v.T
            res = float(misfit(z).sqrt())
        if best is None or res < best[0]:
            best = (res, z)
        if res < stop:
            break
    assert best is not None
    return RankNResult(best[1].to(grads[0].dtype), best[0], rank)


def invert_class_gradients(
    model: FeatureClassifier,
    states: Sequence[Mapping[str, Tensor]],
    heads: Sequence[tuple[Tensor, Tensor | None]],
    grads: Sequence[Tensor],
    label: int,
    n: int,
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    config: InversionConfig | None = None,
) -> GradientInversionResult:
    """n images of class ``label`` whose CReFF class gradients reproduce those a client
    uploaded in several rounds: release r was computed with the extractor of ``states[r]``
    (the model state the server sent) and the head ``heads[r]``; the objective is the mean
    over releases of ``1 - cos(G_r(x), g_r)`` over ``[dW | db]`` (Geiping et al. 2020's
    cosine, one term per round), with the TV prior, box constraint and convergence test of
    ``optimise_images``. Every release adds C (d + 1) equations on the same images, so
    rounds together pin images one release leaves open (n > C - 1, or features the
    extractor maps alike). Needs the same samples in every release (CReFF's per-class cap
    ``client_draws * draw_size`` is above n) and the model runs in eval mode.
    """
    (res,) = invert_class_gradients_many(
        model, states, heads, [(grads, label, n)], image_shape=image_shape, mean=mean,
        std=std, generators=[generator], config=config)
    return res


def invert_class_gradients_many(
    model: FeatureClassifier,
    states: Sequence[Mapping[str, Tensor]],
    heads: Sequence[tuple[Tensor, Tensor | None]],
    targets: Sequence[tuple[Sequence[Tensor], int, int]],
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generators: Sequence[torch.Generator],
    config: InversionConfig | None = None,
) -> list[GradientInversionResult]:
    """``invert_class_gradients`` for several targets ``(grads, label, n)`` released under
    the same states and heads (clients' class gradients of the same rounds), optimised
    together (``engine.optimise_batch``: per-target generator, stop and best restart, so
    each result is the one the target gets alone, up to float rounding)."""
    from torch.func import functional_call

    from privfedcal.attacks.engine import optimise_batch

    if not states or len(states) != len(heads) or any(len(g) != len(states)
                                                      for g, _, _ in targets):
        raise UsageError("need one model state, head and class gradient per release")
    if len(generators) != len(targets):
        raise UsageError("need one generator per target")
    cfg = config or InversionConfig(restarts=1, tv_weight=1e-2, l2_weight=0.0, jitter=0,
                                    bn_weight=0.0)
    device = next(model.parameters()).device
    wrapped = _Features(model)  # functional_call with each release's state, model untouched
    sent = [{"model." + k: v.to(device) for k, v in st.items()} for st in states]
    hs = [(w.to(device).float(), None if b is None else b.to(device).float()) for w, b in heads]
    # (T, releases, C * (d + 1)) observed gradients; one-hot labels (T, C); image counts (T,)
    gs = torch.stack([torch.stack([g.to(device).float().flatten() for g in grads])
                      for grads, _, _ in targets])
    onehot = F.one_hot(torch.tensor([lab for _, lab, _ in targets], device=device),
                       hs[0][0].shape[0]).float()
    counts = torch.tensor([n for _, _, n in targets], device=device, dtype=torch.float32)
    r = cfg.restarts

    def objective(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        w_img = valid[:, None, :, None].float()  # (A, 1, Bmax, 1): padding images count 0
        # padding images skip the model: valid ones in, features scattered back
        idx = torch.nonzero(valid[:, None].expand(-1, x.shape[1], -1).reshape(-1))[:, 0]
        flat = x.flatten(0, 2)
        inp = flat.index_select(0, idx)
        terms = []
        for k, (st, (w, b)) in enumerate(zip(sent, hs, strict=True)):
            zv = functional_call(wrapped, st, (inp,))
            z = zv.new_zeros(flat.shape[0], zv.shape[-1]).index_copy(0, idx, zv)
            z = z.view(*x.shape[:3], -1)
            logits = z @ w.T + (0 if b is None else b)
            resid = (torch.softmax(logits, -1) - onehot[act][:, None, None]) * w_img
            zb = torch.cat([z, torch.ones_like(z[..., :1])], -1)
            # _head_gradient per (target, restart): residuals^T [z | 1] / n
            sim = (resid.transpose(-1, -2) @ zb / counts[act][:, None, None, None]).flatten(2)
            g = gs[act, k][:, None]
            terms.append(1 - (sim * g).sum(-1) / (sim.norm(dim=-1).clamp_min(1e-12)
                                                   * g.norm(dim=-1).clamp_min(1e-12)))
        return torch.stack(terms).mean(0)

    def error(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        with torch.enable_grad():
            return torch.sqrt(2 * objective(x, act, valid).detach().clamp_min(0))

    with eval_mode(model):
        outs = optimise_batch(
            objective, batches=[n for _, _, n in targets], restarts=r, image_shape=image_shape,
            mean=mean, std=std, config=cfg, generators=generators, device=device,
            dtype=next(model.parameters()).dtype, error=error)
        results = []
        for t, ((_, label, n), out) in enumerate(zip(targets, outs, strict=True)):
            with torch.no_grad():
                one = out.images[None, None]  # as a batch of one target, one restart
                ok = torch.ones(1, n, dtype=torch.bool, device=device)
                cos = 1 - float(objective(one, torch.tensor([t], device=device), ok)[0, 0])
            results.append(GradientInversionResult(
                images=to_pixels(out.images, mean, std),
                labels=torch.full((n,), int(label), dtype=torch.long), gradient_cosine=cos,
                loss=float(out.losses[out.best]), restart_losses=out.losses,
                convergence=out.convergence))
    return results


class _Features(torch.nn.Module):
    """``model.features`` as a module's forward, for ``torch.func.functional_call``."""

    def __init__(self, model: FeatureClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.features(x)


# ---- recorded model updates: multi-step local training, simulated ------------------------------
@dataclass(frozen=True)
class LocalRecipe:
    """The public local-training recipe a transcript records next to a model update."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise UsageError("a local recipe needs epochs >= 1, batch_size >= 1 and lr > 0")


def simulate_local_training(
    model: FeatureClassifier,
    start: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    recipe: LocalRecipe,
    *,
    order: Sequence[Tensor] | None = None,
) -> dict[str, Tensor]:
    """The trainable parameters after ``recipe`` (SGD with momentum and weight decay as in
    ``torch.optim.SGD``, mean cross-entropy per batch, batches of ``order[epoch]`` or in
    order, a last batch of one skipped as in local training) from ``start``, differentiable
    with respect to ``x`` (``torch.func.functional_call``; the model's own tensors are not
    touched). BatchNorm runs on batch statistics, as in local training."""
    from torch.func import functional_call

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: start[n].detach().to(x.device).clone().requires_grad_(True) for n in names}
    buffers = {n: start[n].detach().to(x.device).clone() for n, _ in model.named_buffers()
               if n in start}
    momentum: dict[str, Tensor] = {}
    n = x.shape[0]
    was = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        for epoch in range(recipe.epochs):
            perm = order[epoch] if order is not None else torch.arange(n, device=x.device)
            for s in range(0, n, recipe.batch_size):
                b = perm[s:s + recipe.batch_size]
                if b.numel() < 2 <= n:
                    continue
                out = functional_call(model, {**params, **buffers}, (x[b],))
                loss = F.cross_entropy(out, y[b])
                grads = torch.autograd.grad(loss, [params[k] for k in names], create_graph=True)
                new = {}
                for k, g in zip(names, grads, strict=True):
                    if recipe.weight_decay:
                        g = g + recipe.weight_decay * params[k]
                    if recipe.momentum:
                        g = g if k not in momentum else recipe.momentum * momentum[k] + g
                        momentum[k] = g
                    new[k] = params[k] - recipe.lr * g
                params = new
    finally:
        for m, training in was:
            m.training = training
    return params


def labels_from_update(bias_delta: Tensor, n: int) -> Tensor:
    """Labels of n samples from the classifier-bias change of several local SGD steps.

    Every step moves bias j by ``lr / B * sum_batch (y_ij - p_ij)``: up for classes the
    batch holds more of than the model predicts, down for absent ones. Our estimate: the
    classes whose bias rose are present, and the n labels are split among them in
    proportion to the rise (at least one each; largest remainders). Sorted, shape (n,).
    """
    if n < 1:
        raise UsageError(f"n must be >= 1, got {n}")
    rise = bias_delta.detach().double().reshape(-1).clamp_min(0)
    if float(rise.sum()) <= 0:
        rise = torch.zeros_like(rise)
        rise[int(bias_delta.argmax())] = 1.0
    present = torch.nonzero(rise > 0).flatten()
    if present.numel() > n:
        present = present[torch.argsort(rise[present], descending=True)[:n]]
    share = rise[present] / rise[present].sum() * n
    counts = torch.ones_like(share) + torch.floor((share - 1).clamp_min(0))
    while int(counts.sum()) > n:
        counts[int(torch.argmax(counts - share))] -= 1
    while int(counts.sum()) < n:
        counts[int(torch.argmax(share - counts))] += 1
    return torch.repeat_interleave(present, counts.long()).to(bias_delta.device)


def invert_model_update(
    model: FeatureClassifier,
    start: Mapping[str, Tensor],
    after: Mapping[str, Tensor],
    recipe: LocalRecipe,
    *,
    n: int,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    labels: Tensor | None = None,
    order: Sequence[Tensor] | None = None,
    config: InversionConfig | None = None,
) -> GradientInversionResult:
    """Images whose simulated local training reproduces a recorded model update.

    ``start``: the global state the client received; ``after``: its full state after
    local training (the transcript's ``model-update`` entry); ``recipe``: the recorded
    public recipe; ``n``: the client's sample count (its aggregation weight). Labels come
    first, from the classifier-bias change (``labels_from_update``); then n images are
    optimised so that ``simulate_local_training`` from ``start`` moves the parameters in
    the observed direction (cosine over all trainable parameters, Geiping et al. 2020 for
    several local steps), with a TV prior, box constraint and the convergence test of
    ``optimise_images``. ``order`` (one index permutation per epoch) reproduces the
    client's batch schedule when the attacker can; otherwise batches are consecutive.
    """
    cfg = config or InversionConfig(restarts=1, tv_weight=1e-2, l2_weight=0.0, jitter=0,
                                    bn_weight=0.0)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    missing = [k for k in names if k not in start or k not in after]
    if missing:
        raise UsageError(f"the recorded states lack parameters {missing[:3]}")
    device = next(model.parameters()).device
    delta = torch.cat([(after[k].to(device).double() - start[k].to(device).double()).flatten()
                       for k in names]).float()
    if labels is None:
        labels = labels_from_update(after[_bias_name(model)].to(device)
                                    - start[_bias_name(model)].to(device), n)
    labels = torch.as_tensor(labels, dtype=torch.long, device=device).reshape(-1)
    if labels.numel() != n:
        raise UsageError(f"need {n} labels, got {labels.numel()}")
    # labels sit at seeded random positions, so batch label mixtures look like shuffled data
    pos = torch.randperm(n, generator=generator).to(device)
    labels = labels[pos]
    d_norm = delta.norm().clamp_min(1e-12)

    def objective(x: Tensor) -> Tensor:
        out = []
        for xr in x.split(n):
            new = simulate_local_training(model, start, xr, labels, recipe, order=order)
            sim = torch.cat([(new[k] - start[k].to(device)).flatten() for k in names])
            out.append(1 - (sim @ delta) / (sim.norm().clamp_min(1e-12) * d_norm))
        return torch.stack(out)

    def error(x: Tensor) -> Tensor:
        return torch.sqrt(2 * objective(x).detach().clamp_min(0))

    x, final, best, conv = optimise_images(
        objective, restarts=cfg.restarts, batch=n, image_shape=image_shape, mean=mean,
        std=std, config=cfg, generator=generator, device=device,
        dtype=next(model.parameters()).dtype, error=error)
    cos = 1 - float(objective(x).detach()[0])
    return GradientInversionResult(
        images=to_pixels(x, mean, std), labels=labels, gradient_cosine=cos,
        loss=float(final[best]), restart_losses=final, convergence=conv)
