"""Model-update inversion (Geiping et al. 2020, "Inverting Gradients"): images from a
client's gradient or model update, and from a recorded update of several local steps.

Images are optimised so that the parameter gradient they produce has cosine similarity 1
with the observed one (over all parameters at once), with a TV prior, box constraint and
restarts. Labels come first from the last-layer bias gradient
(iDLG). A model update after several local SGD steps is treated as ``-lr * gradient``
(exact for one full-batch step; an approximation otherwise, best for few steps and small
lr); since the cosine ignores scale, lr need not be known.

A recorded update of several local steps is inverted through ``simulate_local_training``
(the transcript's public recipe), labels first from the classifier-bias change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.attacks.reconstruction.feature_inversion import (
    DEFAULT_MAX_STEPS,
    InversionConfig,
    optimise_images,
    to_pixels,
)
from privfedcal.attacks.reconstruction.gradient_inversion import (
    GradientInversionResult,
    labels_from_bias_gradient,
)
from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier


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


def _update_labels(model: FeatureClassifier, observed: Mapping[str, Tensor], kind: str,
                   batch_size: int, labels: Tensor | None) -> Tensor:
    """The ``batch_size`` labels of the batch: given, or from the bias entry's signs (and,
    for a gradient, magnitudes; an update's scale is unknown)."""
    if labels is None:
        b_name = _bias_name(model)
        bias = observed[b_name] * (-1.0 if kind == "update" else 1.0)
        labels = labels_from_bias_gradient(bias, batch_size, use_magnitudes=kind == "gradient")
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    if labels.numel() != batch_size:
        raise UsageError(f"need {batch_size} labels, got {labels.numel()}")
    return labels


def _cosine_objective(model: FeatureClassifier, plist: list[Tensor], targets: list[Tensor],
                      labels: Tensor, batch_size: int
                      ) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """(objective, error) of the gradient match: per restart, 1 - cosine between the CE
    gradient of its images and the target; the error is sqrt(2 (1 - cos)), the relative
    error between unit-normalised gradients."""
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

    return objective, error


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
    params = dict(model.named_parameters())
    plist: list[Tensor] = [params[n] for n in names]
    device = plist[0].device
    labels = _update_labels(model, observed, kind, batch_size, labels).to(device)
    objective, error = _cosine_objective(model, plist, targets, labels, batch_size)

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


def _observed_delta(model: FeatureClassifier, start: Mapping[str, Tensor],
                    after: Mapping[str, Tensor], device: torch.device
                    ) -> tuple[list[str], Tensor]:
    """(trainable parameter names, the recorded update ``after - start`` over them, flat)."""
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    missing = [k for k in names if k not in start or k not in after]
    if missing:
        raise UsageError(f"the recorded states lack parameters {missing[:3]}")
    delta = torch.cat([(after[k].to(device).double() - start[k].to(device).double()).flatten()
                       for k in names]).float()
    return names, delta


def _update_batch_labels(model: FeatureClassifier, start: Mapping[str, Tensor],
                         after: Mapping[str, Tensor], n: int, labels: Tensor | None,
                         generator: torch.Generator, device: torch.device) -> Tensor:
    """The n labels (given, or from the bias change, ``labels_from_update``) at seeded
    random positions (one ``randperm`` from ``generator``)."""
    if labels is None:
        labels = labels_from_update(after[_bias_name(model)].to(device)
                                    - start[_bias_name(model)].to(device), n)
    labels = torch.as_tensor(labels, dtype=torch.long, device=device).reshape(-1)
    if labels.numel() != n:
        raise UsageError(f"need {n} labels, got {labels.numel()}")
    # labels sit at seeded random positions, so batch label mixtures look like shuffled data
    pos = torch.randperm(n, generator=generator).to(device)
    return labels[pos]


def _training_objective(model: FeatureClassifier, start: Mapping[str, Tensor],
                        names: list[str], delta: Tensor, labels: Tensor, recipe: LocalRecipe,
                        n: int, order: Sequence[Tensor] | None
                        ) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """(objective, error): per restart, 1 - cosine between the update its n images make
    under ``simulate_local_training`` and the recorded ``delta``; the error is
    sqrt(2 (1 - cos))."""
    device = delta.device
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

    return objective, error


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
    device = next(model.parameters()).device
    names, delta = _observed_delta(model, start, after, device)
    labels = _update_batch_labels(model, start, after, n, labels, generator, device)
    objective, error = _training_objective(model, start, names, delta, labels, recipe, n,
                                           order)
    x, final, best, conv = optimise_images(
        objective, restarts=cfg.restarts, batch=n, image_shape=image_shape, mean=mean,
        std=std, config=cfg, generator=generator, device=device,
        dtype=next(model.parameters()).dtype, error=error)
    cos = 1 - float(objective(x).detach()[0])
    return GradientInversionResult(
        images=to_pixels(x, mean, std), labels=labels, gradient_cosine=cos,
        loss=float(final[best]), restart_losses=final, convergence=conv)
