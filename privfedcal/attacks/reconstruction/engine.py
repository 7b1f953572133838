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

Work is counted in restart-steps (one step of one restart of one target): an optimisation
sets out to run ``targets x steps x restarts`` of them and runs fewer when targets stop
early. Every ``optimise_batch`` inside ``reporting(sink)`` tells ``sink`` what it planned,
what it ran (each step) and what its early stops saved, so a caller (``runner.execute``)
shows progress and an ETA in the engine's own unit, not in targets.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from privfedcal.errors import UsageError

#: default step cap: breaching-scale (Inverting Gradients runs 24,000 Adam steps)
DEFAULT_MAX_STEPS = 24_000
#: targets optimised together (``runner.execute``, ``engine.py``): a digits run's targets
#: fit in one batch; memory grows with it (every target's images and activations at once)
DEFAULT_ATTACK_BATCH = 32


@dataclass(frozen=True)
class InversionConfig:
    """Optimiser, stopping rule and priors. Weights are relative to a feature loss of order 1.

    Stopping (``optimise_images``): every ``check_every`` steps the relative feature error
    of the best restart (by objective) is measured; the run stops when it is <= ``tol``
    ("converged"), when the step-size has been halved down to ``lr * min_lr_ratio`` because
    the objective stopped improving ("plateau": no relative improvement above
    ``min_improvement`` over ``patience`` checks halves the step size), or at ``steps``
    ("cap"). The step size also follows a cosine decay over ``steps``, so a short run
    (``steps`` lowered for a quick look) still ends on a small step.
    """

    steps: int = DEFAULT_MAX_STEPS  # cap; the stopping rule usually ends the run earlier
    lr: float = 0.1  # Adam, in normalised input units
    restarts: int = 4
    # mean absolute neighbour difference, pixel space; None: by image size (``tv_for``)
    tv_weight: float | None = None
    l2_weight: float = 1e-5  # mean squared normalised input
    jitter: int | None = None  # max shift in pixels per step; None: 0 (``jitter_for``)
    bn_weight: float = 1e-2  # only used when the model has BatchNorm layers
    # start: pixels uniform in [0.5 - s/2, 0.5 + s/2]; 1 = uniform on [0, 1]. Components of
    # the image the model ignores keep their start, so a smaller s leaves less noise there
    init_scale: float = 1.0
    tol: float = 1e-4  # relative feature error at which the inversion counts as converged
    check_every: int = 100  # steps between checks (one host sync per check)
    patience: int = 2  # checks without improvement before the step size is halved
    min_improvement: float = 1e-3  # relative objective improvement that counts
    min_lr_ratio: float = 1e-2  # stop once the step size fell below lr * this

    def __post_init__(self) -> None:
        if self.steps < 0 or self.restarts < 1:
            raise UsageError("inversion needs steps >= 0 and restarts >= 1")
        if not self.lr > 0:
            raise UsageError(f"inversion lr must be > 0, got {self.lr}")
        if min(self.tv_weight or 0.0, self.l2_weight, self.bn_weight) < 0:
            raise UsageError("prior weights must be >= 0")
        if not 0 <= self.init_scale <= 1:
            raise UsageError(f"init_scale must be in [0, 1], got {self.init_scale}")
        if self.jitter is not None and self.jitter < 0:
            raise UsageError(f"jitter must be >= 0, got {self.jitter}")
        if self.tol < 0 or self.check_every < 1 or self.patience < 1:
            raise UsageError("need tol >= 0, check_every >= 1 and patience >= 1")
        if not 0 < self.min_lr_ratio <= 1 or self.min_improvement < 0:
            raise UsageError("need 0 < min_lr_ratio <= 1 and min_improvement >= 0")

    def jitter_for(self, height: int, width: int) -> int:
        """Jitter in pixels: the set value, else 0 at every size. Shifting the image at
        every step makes the optimiser match shifted copies' features too; on CIFAR-10
        with the CNN a 2-pixel jitter left the relative feature error of an image's own
        feature at 0.05, no jitter at 0.01-0.04 (docs/results/privacy.md)."""
        del height, width
        return 0 if self.jitter is None else self.jitter

    def tv_for(self, height: int, width: int) -> float:
        """TV weight: the set value, else by image size. 1e-3 below 16 px (8x8 digits: a
        weak prior, the features pin the image down); 0.3 from 16 px (32x32 colour
        images: the CNN's features leave most of the image free, and a weak prior leaves
        the start's noise there; measured on CIFAR-10, docs/results/privacy.md)."""
        if self.tv_weight is not None:
            return self.tv_weight
        return 1e-3 if min(height, width) < 16 else 0.3


@dataclass(frozen=True)
class Convergence:
    """How an optimisation ended: steps run, the kept restart's relative feature error
    (NaN when no error function was given) and why it stopped (converged|plateau|cap)."""

    steps: int
    error: float
    stopped: str

    def as_record(self) -> dict[str, object]:
        return {"steps_run": self.steps, "feature_error": self.error,
                "converged": self.stopped == "converged", "stopped": self.stopped}


def channel_stats(
    mean: Sequence[float],
    std: Sequence[float],
    channels: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Per-channel mean and std as (1, C, 1, 1) tensors, validated."""
    m = torch.as_tensor(mean, dtype=dtype, device=device).reshape(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=dtype, device=device).reshape(1, -1, 1, 1)
    if m.shape[1] != channels or s.shape[1] != channels or not bool((s > 0).all()):
        raise UsageError(f"mean/std need {channels} entries (std > 0), one per image channel")
    return m, s


def total_variation(pixels: Tensor) -> Tensor:
    """Mean absolute difference between neighbours, per image: (B,C,H,W) -> (B,)."""
    tv = pixels.new_zeros(pixels.shape[0])
    if pixels.shape[-2] > 1:
        tv = tv + (pixels[..., 1:, :] - pixels[..., :-1, :]).abs().flatten(1).mean(1)
    if pixels.shape[-1] > 1:
        tv = tv + (pixels[..., :, 1:] - pixels[..., :, :-1]).abs().flatten(1).mean(1)
    return tv

class WorkSink(Protocol):
    """Receives an optimisation's work (``reporting``) in restart-steps, and in image-steps
    (restart-steps times the target's images: what a step costs, for an ETA)."""

    def planned(self, steps: int, images: int) -> None:
        """An optimisation starts and will run at most ``steps`` (``images``)."""

    def advance(self, steps: int, images: int) -> None:
        """``steps`` (``images``) more were run."""

    def saved(self, steps: int, images: int) -> None:
        """Targets stopped early: ``steps`` (``images``) of the planned will not run."""

    def stopped(self, run: int, planned: int) -> None:
        """Targets stopped (early or at the cap) after ``run`` of their ``planned``
        image-steps: how far below the cap targets stop, for an ETA."""


_SINK: ContextVar[WorkSink | None] = ContextVar("privfedcal_attack_work", default=None)


@contextlib.contextmanager
def reporting(sink: WorkSink) -> Iterator[WorkSink]:
    """Every ``optimise_batch`` run in this block (this thread or task) reports to ``sink``."""
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


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
    sink = _SINK.get()
    if sink is not None:
        sink.planned(t_count * cap * r, sum(batches) * cap * r)
    act_images = sum(batches)  # images per restart of the active targets

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
        if sink is not None:
            stopped = sum(batches[int(active_list[row])] for row in rows)
            sink.saved(len(rows) * (cap - step) * r, stopped * (cap - step) * r)
            sink.stopped(stopped * step * r, stopped * cap * r)

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
        if sink is not None:
            sink.advance(n_act * r, act_images * r)
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
                act_images -= sum(batches[active_list[row]] for row in done)
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
