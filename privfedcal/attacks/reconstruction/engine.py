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
    run = _Batch(objective, error, traces, batches, restarts, image_shape, mean, std, config,
                 generators, device, dtype)
    while run.step < run.cap and run.n_act:
        run.adam_step()
        if run.step % config.check_every == 0 and run.step < run.cap:
            run.check()
    if run.n_act:
        ok = run.valid[run.active]
        losses = run.total(run.x, run.x, run.active, ok).detach()
        run.finish(list(range(run.n_act)), losses, run.errors(run.active, ok),
                   ["cap"] * run.n_act)
    return [o for o in run.outcomes if o is not None]


class _Batch:
    """``optimise_batch``'s state: the images ``x`` (A, R, Bmax, C, H, W) of the A targets
    still active and their Adam moments, each target's step-size factor and stopping
    counters, and the outcomes of the targets that have stopped."""

    def __init__(self, objective: Callable[[Tensor, Tensor, Tensor], Tensor],
                 error: Callable[[Tensor, Tensor, Tensor], Tensor] | None,
                 traces: Sequence[Callable[[int, Tensor], None] | None] | None,
                 batches: Sequence[int], restarts: int, image_shape: Sequence[int],
                 mean: Sequence[float], std: Sequence[float], config: InversionConfig,
                 generators: Sequence[torch.Generator], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.objective, self.error, self.traces = objective, error, traces
        self.batches, self.r, self.config = list(batches), restarts, config
        self.generators, self.device, self.dtype = generators, device, dtype
        c, h, w = (int(s) for s in image_shape)
        t_count = len(batches)
        self.bmax = max(batches)
        self.m, self.s = channel_stats(mean, std, c, device, dtype)
        self.lo, self.hi = (0 - self.m) / self.s, (1 - self.m) / self.s
        self.x = self._start_images(c, h, w)
        self.valid = (torch.arange(self.bmax, device=device)[None]
                      < torch.tensor(batches, device=device)[:, None])
        self.active = torch.arange(t_count, device=device)
        self.padded = not bool(self.valid.all())
        self.jitter, self.tv_weight = config.jitter_for(h, w), config.tv_for(h, w)
        self.cap = config.steps
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.x), torch.zeros_like(self.x)
        self.sink = _SINK.get()
        if self.sink is not None:
            self.sink.planned(t_count * self.cap * self.r, sum(batches) * self.cap * self.r)
        self.act_images = sum(batches)  # images per restart of the active targets
        self.outcomes: list[Outcome | None] = [None] * t_count
        self.n_act = t_count
        self.factor = [1.0] * t_count
        self.best_loss = [math.inf] * t_count
        self.bad = [0] * t_count
        self.shifts: list[list[list[int]]] = [[] for _ in range(t_count)]
        self.step = 0
        self.active_list: list[int] = self.active.tolist()

    def _start_images(self, c: int, h: int, w: int) -> Tensor:
        """Each target's uniform random start, drawn from its own generator, normalised."""
        r, bmax = self.r, self.bmax
        x = torch.zeros(len(self.batches), r, bmax, c, h, w, device=self.device,
                        dtype=self.dtype)
        for t, (b, gen) in enumerate(zip(self.batches, self.generators, strict=True)):
            pixels = torch.rand(r * b, c, h, w, generator=gen, device=gen.device)
            if self.config.init_scale != 1.0:  # 1.0 keeps the plain uniform draw bit for bit
                pixels = 0.5 + self.config.init_scale * (pixels - 0.5)
            x[t, :, :b] = ((pixels.to(device=self.device, dtype=self.dtype) - self.m)
                           / self.s).view(r, b, c, h, w)
        return x

    def per_image_mean(self, values: Tensor, ok: Tensor) -> Tensor:
        """(A*R*Bmax,) -> (A, R): mean over each restart's valid images."""
        values = values.view(ok.shape[0], self.r, self.bmax)
        if not self.padded:
            return values.mean(-1)
        mask = ok[:, None].to(values.dtype)
        return (values * mask).sum(-1) / mask.sum(-1)

    def total(self, inp: Tensor, xs: Tensor, act: Tensor, ok: Tensor) -> Tensor:
        """The objective plus the TV and L2 priors, (A, R)."""
        loss = self.objective(inp, act, ok)
        flat = xs.flatten(0, 2)
        if self.tv_weight:
            loss = loss + self.tv_weight * self.per_image_mean(
                total_variation(flat * self.s + self.m), ok)
        if self.config.l2_weight:
            loss = loss + self.config.l2_weight * self.per_image_mean(
                flat.pow(2).flatten(1).mean(1), ok)
        return loss

    def errors(self, act: Tensor, ok: Tensor) -> Tensor:
        """Each restart's relative error (NaN without an ``error``), (A, R)."""
        if self.error is None:
            return torch.full((act.numel(), self.r), math.nan, device=self.device,
                              dtype=self.dtype)
        return self.error(self.x, act, ok).detach().to(self.dtype)

    def trace(self, t: int, images: Tensor) -> None:
        """Target t's best restart, (Bmax, C, H, W) -> its own (B_t, C, H, W) images."""
        trace = None if self.traces is None else self.traces[t]
        if trace is not None:
            trace(self.step, images[: self.batches[t]].clone())

    def adam_step(self) -> None:
        """One Adam step of every active target (each jittered by its own shift), under the
        cosine schedule scaled by the target's factor, then clamped to valid pixels."""
        ok = self.valid[self.active]
        self._draw_shifts()
        cos = 0.5 * (1 + math.cos(math.pi * self.step / max(self.cap, 1)))
        self.step += 1
        bias1 = 1 - BETA1**self.step
        sizes = torch.tensor([self.config.lr * self.factor[t] * cos / bias1
                              for t in self.active_list],
                             device=self.device, dtype=self.dtype).view(-1, 1, 1, 1, 1, 1)
        x = self.x
        x.requires_grad_(True)
        inp = x
        if self.jitter:  # each target rolled by its own shift (a loop over targets, not images)
            inp = torch.stack([torch.roll(x[a], shifts=tuple(self.shifts[t].pop()),
                                          dims=(-2, -1))
                               for a, t in enumerate(self.active_list)])
        (grad,) = torch.autograd.grad(self.total(inp, x, self.active, ok).sum(), x)
        self.x = x = x.detach()
        _adam_step(x, grad, self.exp_avg, self.exp_avg_sq, self.step, sizes)
        x.copy_(torch.maximum(torch.minimum(x, self.hi), self.lo))
        if self.sink is not None:
            self.sink.advance(self.n_act * self.r, self.act_images * self.r)

    def _draw_shifts(self) -> None:
        """A block of jitter shifts per active target that has used its last one, from its
        own generator: no per-step host sync."""
        for t in self.active_list if self.jitter else ():
            if not self.shifts[t]:
                g = self.generators[t]
                self.shifts[t] = torch.randint(-self.jitter, self.jitter + 1,
                                               (self.config.check_every, 2),
                                               generator=g, device=g.device).tolist()

    def check(self) -> None:
        """The stopping rule at a check: targets whose error is within ``tol`` or whose
        step size has been halved below ``min_lr_ratio`` stop and leave the batch."""
        # no torch.no_grad(): a gradient-matching objective differentiates inside
        ok = self.valid[self.active]
        losses = self.total(self.x, self.x, self.active, ok).detach()
        errs = self.errors(self.active, ok)
        best = losses.argmin(1, keepdim=True)
        both = torch.stack([losses.gather(1, best)[:, 0], errs.gather(1, best)[:, 0]], 1)
        done, why = [], []
        for row, (loss_now, err_now) in enumerate(both.tolist()):  # one host sync
            stop = self._judge(self.active_list[row], loss_now, err_now)
            if stop is not None:
                done.append(row)
                why.append(stop)
        for row in range(self.n_act) if self.traces is not None else ():
            self.trace(self.active_list[row], self.x.detach()[row, int(best[row])])
        if done:
            self.finish(done, losses, errs, why)
            self._drop(done)

    def _judge(self, t: int, loss_now: float, err_now: float) -> str | None:
        """Target t at a check, from its best restart's loss and error: "converged",
        "plateau", or None (it goes on; its step size halves after ``patience`` checks
        without ``min_improvement``)."""
        config = self.config
        if err_now <= config.tol:
            return "converged"
        if loss_now < self.best_loss[t] * (1 - config.min_improvement) or not math.isfinite(
                self.best_loss[t]):
            self.best_loss[t], self.bad[t] = loss_now, 0
            return None
        self.bad[t] += 1
        if self.bad[t] >= config.patience:
            self.factor[t], self.bad[t] = self.factor[t] / 2, 0
            if self.factor[t] < config.min_lr_ratio:
                return "plateau"
        return None

    def _drop(self, done: list[int]) -> None:
        """Remove the rows ``done`` (positions among the active) from the batch."""
        self.act_images -= sum(self.batches[self.active_list[row]] for row in done)
        keep = torch.tensor([row for row in range(self.n_act) if row not in done],
                            dtype=torch.long, device=self.device)
        self.x, self.exp_avg = self.x[keep], self.exp_avg[keep]
        self.exp_avg_sq = self.exp_avg_sq[keep]
        self.active = self.active[keep]
        self.active_list, self.n_act = self.active.tolist(), int(keep.numel())

    def finish(self, rows: list[int], losses: Tensor, errs: Tensor, why: list[str]) -> None:
        """Record the targets in ``rows`` (positions among the active) as they are now."""
        best = losses[rows].argmin(1)
        ix = torch.tensor(rows, device=self.device)
        err_best = errs[ix, best]
        for k, (row, b, e) in enumerate(zip(rows, best.tolist(), err_best.tolist(),
                                            strict=True)):
            t = int(self.active_list[row])
            stopped = "converged" if why[k] == "cap" and e <= self.config.tol else why[k]
            images = self.x.detach()[row, b]
            self.trace(t, images)
            self.outcomes[t] = Outcome(images[: self.batches[t]].clone(), losses[row].clone(),
                                       b, Convergence(self.step, e, stopped))
        if self.sink is not None:
            stopped_images = sum(self.batches[int(self.active_list[row])] for row in rows)
            left = self.cap - self.step
            self.sink.saved(len(rows) * left * self.r, stopped_images * left * self.r)
            self.sink.stopped(stopped_images * self.step * self.r,
                              stopped_images * self.cap * self.r)
