"""The inversion optimiser, batched over targets: several targets (each with its restarts)
are optimised in one loop, one forward/backward pass over all their images per step.

Why it gives the same result as one target at a time: the loss is the SUM of the
targets' objectives, so the gradient with respect to a target's images is its own
objective's gradient; Adam is element-wise, so each target's update is the one it would
get alone (the step size, which the stopping rule halves per target, is a per-target
factor). A target leaves the batch at the check where it stops (converged or plateau,
``InversionConfig``), with its own step count, and later steps no longer compute it.
Targets with fewer images than the largest are padded; padded images are masked out of
every loss term (``valid``), so they get no gradient and never move. The cost is memory:
all images of the batch and their activations are held at once (``attack_batch`` in
``runner.execute`` caps the number of targets per batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from privfedcal.attacks.feature_inversion import (
    Convergence,
    InversionConfig,
    channel_stats,
    total_variation,
)

#: Adam's defaults (torch.optim.Adam), applied by ``_adam_step`` exactly as torch does
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


@dataclass(frozen=True, eq=False)
class Outcome:
    """One target's result: its best restart's images (B_t, C, H, W, normalised), the
    final objective of every restart (R,), the best restart and how the run ended."""

    images: Tensor
    losses: Tensor
    best: int
    convergence: Convergence


def _adam_step(x: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int,
               step_sizes: Tensor) -> None:
    """torch.optim.Adam's update (single-tensor CPU path, same operations in the same
    order), with a step size per target: ``step_sizes`` (A, 1, ...) = lr_t / (1 - beta1^t)."""
    m.lerp_(grad, 1 - BETA1)
    v.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
    denom = (v.sqrt() / (1 - BETA2**step) ** 0.5).add_(EPS)
    x.add_((m / denom).mul_(step_sizes.neg()))


def optimise_batch(
    objective: Callable[[Tensor, Tensor, Tensor], Tensor],
    *,
    batches: Sequence[int],
    restarts: int,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    config: InversionConfig,
    generators: Sequence[torch.Generator],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    error: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
    traces: Sequence[Callable[[int, Tensor], None] | None] | None = None,
) -> list[Outcome]:
    """Minimise T objectives at once. Target t has ``batches[t]`` images per restart and
    draws its start (and jitter) from ``generators[t]``, exactly as it would alone.

    ``objective(x, active, valid) -> (A, R)``: x is (A, R, Bmax, C, H, W) normalised images
    of the A still-active targets (``active``: their indices into the T targets), ``valid``
    (A, Bmax) bool marks real (not padding) images. ``error`` (same signature, no gradient
    needed) is the relative error of each restart that drives the stopping rule. The TV
    and L2 priors are added here, averaged over valid images. ``traces[t](step, x_best)``
    sees target t's best restart (normalised) at every check and at the end.
    """
    c, h, w = (int(s) for s in image_shape)
    t_count, r = len(batches), restarts
    bmax = max(batches)
    m, s = channel_stats(mean, std, c, device, dtype)
    lo, hi = (0 - m) / s, (1 - m) / s
    x = torch.zeros(t_count, r, bmax, c, h, w, device=device, dtype=dtype)
    for t, (b, gen) in enumerate(zip(batches, generators, strict=True)):
        pixels = torch.rand(r * b, c, h, w, generator=gen, device=gen.device)
        if config.init_scale != 1.0:  # 1.0 keeps the plain uniform draw bit for bit
            pixels = 0.5 + config.init_scale * (pixels - 0.5)
        x[t, :, :b] = ((pixels.to(device=device, dtype=dtype) - m) / s).view(r, b, c, h, w)
    valid = torch.arange(bmax, device=device)[None] < torch.tensor(batches, device=device)[:, None]
    active = torch.arange(t_count, device=device)
    padded = not bool(valid.all())
    jitter, tv_weight, cap = config.jitter_for(h, w), config.tv_for(h, w), config.steps
    exp_avg, exp_avg_sq = torch.zeros_like(x), torch.zeros_like(x)

    def per_image_mean(values: Tensor, ok: Tensor) -> Tensor:
        """(A*R*Bmax,) -> (A, R): mean over each restart's valid images."""
        values = values.view(ok.shape[0], r, bmax)
        if not padded:
            return values.mean(-1)
        mask = ok[:, None].to(values.dtype)
        return (values * mask).sum(-1) / mask.sum(-1)

    def total(inp: Tensor, xs: Tensor, act: Tensor, ok: Tensor) -> Tensor:
        loss = objective(inp, act, ok)
        flat = xs.flatten(0, 2)
        if tv_weight:
            loss = loss + tv_weight * per_image_mean(total_variation(flat * s + m), ok)
        if config.l2_weight:
            loss = loss + config.l2_weight * per_image_mean(flat.pow(2).flatten(1).mean(1), ok)
        return loss

    def errors(act: Tensor, ok: Tensor) -> Tensor:
        if error is None:
            return torch.full((act.numel(), r), math.nan, device=device, dtype=dtype)
        return error(x, act, ok).detach().to(dtype)

    def trace(t: int, step: int, images: Tensor) -> None:
        """Target t's best restart, (Bmax, C, H, W) -> its own (B_t, C, H, W) images."""
        if traces is not None and traces[t] is not None:
            traces[t](step, images[: batches[t]].clone())  # type: ignore[misc]

    outcomes: list[Outcome | None] = [None] * t_count
    n_act = t_count
    factor = [1.0] * t_count
    best_loss = [math.inf] * t_count
    bad = [0] * t_count
    shifts: list[list[list[int]]] = [[] for _ in range(t_count)]
    step = 0

    def finish(rows: list[int], losses: Tensor, errs: Tensor, why: list[str]) -> None:
        """Record the targets in ``rows`` (positions among the active) as they are now."""
        best = losses[rows].argmin(1)
        ix = torch.tensor(rows, device=device)
        err_best = errs[ix, best]
        for k, (row, b, e) in enumerate(zip(rows, best.tolist(), err_best.tolist(),
                                            strict=True)):
            t = int(active_list[row])
            stopped = "converged" if why[k] == "cap" and e <= config.tol else why[k]
            images = x.detach()[row, b]
            trace(t, step, images)
            outcomes[t] = Outcome(images[: batches[t]].clone(), losses[row].clone(), b,
                                  Convergence(step, e, stopped))

    active_list = active.tolist()
    while step < cap and n_act:
        ok = valid[active]
        for t in active_list if jitter else ():
            if not shifts[t]:  # a block of shifts per target: no per-step host sync
                g = generators[t]
                shifts[t] = torch.randint(-jitter, jitter + 1, (config.check_every, 2),
                                          generator=g, device=g.device).tolist()
        cos = 0.5 * (1 + math.cos(math.pi * step / max(cap, 1)))
        step += 1
        bias1 = 1 - BETA1**step
        sizes = torch.tensor([config.lr * factor[t] * cos / bias1 for t in active_list],
                             device=device, dtype=dtype).view(-1, 1, 1, 1, 1, 1)
        x.requires_grad_(True)
        inp = x
        if jitter:  # each target rolled by its own shift (a loop over targets, not images)
            inp = torch.stack([torch.roll(x[a], shifts=tuple(shifts[t].pop()), dims=(-2, -1))
                               for a, t in enumerate(active_list)])
        (grad,) = torch.autograd.grad(total(inp, x, active, ok).sum(), x)
        x = x.detach()
        _adam_step(x, grad, exp_avg, exp_avg_sq, step, sizes)
        x.copy_(torch.maximum(torch.minimum(x, hi), lo))
        if step % config.check_every == 0 and step < cap:
            # no torch.no_grad(): a gradient-matching objective differentiates inside
            losses = total(x, x, active, ok).detach()
            errs = errors(active, ok)
            best = losses.argmin(1, keepdim=True)
            both = torch.stack([losses.gather(1, best)[:, 0], errs.gather(1, best)[:, 0]], 1)
            done, why = [], []
            for row, (loss_now, err_now) in enumerate(both.tolist()):  # one host sync
                t = active_list[row]
                if err_now <= config.tol:
                    done.append(row), why.append("converged")
                    continue
                if loss_now < best_loss[t] * (1 - config.min_improvement) or not math.isfinite(
                        best_loss[t]):
                    best_loss[t], bad[t] = loss_now, 0
                else:
                    bad[t] += 1
                    if bad[t] >= config.patience:
                        factor[t], bad[t] = factor[t] / 2, 0
                        if factor[t] < config.min_lr_ratio:
                            done.append(row), why.append("plateau")
            for row in range(n_act) if traces is not None else ():
                trace(active_list[row], step, x.detach()[row, int(best[row])])
            if done:
                finish(done, losses, errs, why)
                keep = torch.tensor([row for row in range(n_act) if row not in done],
                                    dtype=torch.long, device=device)
                x, exp_avg, exp_avg_sq = x[keep], exp_avg[keep], exp_avg_sq[keep]
                active = active[keep]
                active_list, n_act = active.tolist(), int(keep.numel())
    if n_act:
        ok = valid[active]
        losses = total(x, x, active, ok).detach()
        finish(list(range(n_act)), losses, errors(active, ok), ["cap"] * n_act)
    return [o for o in outcomes if o is not None]
