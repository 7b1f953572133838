"""DP-SGD for local training (Abadi et al. 2016), built on opacus's per-sample gradients.

Each step draws a Poisson batch (every local example joins independently with probability
``q = dpsgd_sample_rate(batch_size, n)``), clips every per-sample gradient to L2 norm
``max_grad_norm``, sums, adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` and divides by
the expected batch size ``q n``. Each step is then a subsampled Gaussian mechanism
``(noise_multiplier, q)`` on the client's data; record it with
``PrivacyAccountant.record(noise_multiplier, q, steps, label="dp-sgd")``.

What a caller must do (the guarantee holds only then):

1. Build the model with ``prepare_model`` (BatchNorm -> GroupNorm, a COPY) for the whole
   federation, before creating the optimizer: BatchNorm mixes samples of a batch, so it has
   no per-sample gradient, and the global state must have the same keys as the local one.
2. ``pt = make_private_training(model, optimizer, x, y, ...)``; iterate ``pt.loader``
   (all of its batches, empty ones included: skipping them would reveal that they were
   empty; for an empty batch either run the usual step, or call ``pt.noise_only_step()``
   when the loss cannot take 0 rows; a zero loss that bypasses the model does NOT work,
   opacus then finds no per-sample gradients and raises); per batch: ``pt.optimizer.zero_grad()``, ONE forward of ``pt.model`` (or
   ``pt.model.features`` + ``pt.model.classifier``) on the batch, a loss that is the MEAN
   over the batch of per-sample terms, ``backward()``, ``pt.optimizer.step()``. Frozen
   reference models (MOON's global/previous model) must not be part of ``pt.model``.
3. Terms of the loss that depend on the parameters only (FedProx's proximal term, weight
   decay) never reach the per-sample gradients: opacus overwrites ``p.grad`` with the noisy
   clipped sum, so such terms are DROPPED. Add them to ``p.grad`` after the DP step instead
   (data-independent, so post-processing). The same holds for gradient clipping by norm.
4. Call ``pt.close()`` when the client is done: it removes opacus's hooks from the model.

The guarantee does not hold against floating-point attacks on the noise sampler
(opacus ``secure_mode`` is off), and it covers one client's examples at sample level.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.validators import ModuleValidator
from torch import Tensor, nn

from privfedcal.errors import UsageError

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def dpsgd_sample_rate(batch_size: int, n: int) -> float:
    """Poisson sampling rate ``min(1, batch_size / n)`` of a client holding ``n`` examples."""
    if batch_size < 1 or n < 1:
        raise UsageError(f"DP-SGD needs batch_size >= 1 and n >= 1, got {batch_size}, {n}")
    return min(1.0, batch_size / n)


def prepare_model(model: ModuleT) -> ModuleT:
    """The model itself if opacus supports it, else a copy with BatchNorm -> GroupNorm."""
    if ModuleValidator.is_valid(model):
        return model
    # opacus types the copy as a plain Module; it is a deep copy of ``model``, of its class
    fixed = cast(ModuleT, ModuleValidator.fix(model))
    errors = ModuleValidator.validate(fixed, strict=False)
    if errors:
        raise UsageError(f"model cannot be trained with DP-SGD: {errors[0]}")
    return fixed


class PoissonBatches:
    """``steps`` Poisson batches of ``(x, y)``, gathered by index on the tensors' device.

    Batch sizes vary (possibly 0); the masks are drawn on ``generator``'s device. A batch of
    variable size needs its size on the host, so the masks of ``CHUNK_ELEMENTS // n`` steps at
    a time (all of a small client's steps) are drawn together; the host waits for the device
    once per chunk (on a GPU twice: the sizes and ``nonzero``), not once per step.
    """

    #: uniforms drawn per chunk (16 MiB of float32), which bounds the memory of the masks
    CHUNK_ELEMENTS = 1 << 22

    def __init__(self, x: Tensor, y: Tensor, sample_rate: float, steps: int,
                 generator: torch.Generator) -> None:
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(f"x and y must be non-empty and aligned, got {len(x)}, {len(y)}")
        if not 0 < sample_rate <= 1 or steps < 1:
            raise ValueError(f"bad sample rate {sample_rate} or steps {steps}")
        self.x, self.y = x, y
        self.sample_rate, self.steps, self.generator = sample_rate, steps, generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n = len(self.x)
        per_chunk = max(1, self.CHUNK_ELEMENTS // n)
        for first in range(0, self.steps, per_chunk):
            rows = min(per_chunk, self.steps - first)
            mask = torch.rand(rows, n, generator=self.generator,
                              device=self.generator.device) < self.sample_rate
            sizes = mask.sum(1).tolist()  # read back once per chunk
            # row-major: step by step, each step's indices ascending
            members = mask.nonzero()[:, 1].to(self.x.device)
            for idx in members.split(sizes):
                yield self.x[idx], self.y[idx]


@dataclass
class PrivateTraining:
    """What ``make_private_training`` returns; see the module docstring for the protocol."""

    model: nn.Module            # the caller's model, with opacus hooks attached
    optimizer: DPOptimizer
    loader: PoissonBatches
    sample_rate: float
    wrapped: GradSampleModule

    def noise_only_step(self) -> None:
        """The DP step of an EMPTY Poisson batch, without a forward pass: zero per-sample
        gradients, so the update is the noise alone (for losses that cannot take 0 rows)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.optimizer.step()

    def close(self) -> nn.Module:
        """Remove opacus's hooks and per-sample attributes; returns the plain model."""
        return self.wrapped.to_standard_module()


def make_private_training(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor,
                          y: Tensor, *, noise_multiplier: float, max_grad_norm: float,
                          batch_size: int, generator: torch.Generator,
                          steps: int | None = None, sample_rate: float | None = None,
                          expected_batch_size: float | None = None) -> PrivateTraining:
    """Wrap ``model``/``optimizer`` for DP-SGD on one client's ``(x, y)``.

    ``sample_rate`` and ``expected_batch_size`` (the divisor of every step's noisy clipped
    sum) default to ``batch_size / len(x)`` and ``q * len(x)``. The federation passes public
    ones planned for a public nominal size, so that neither the rate nor the update's scale
    depends on ``len(x)``. ``steps`` defaults to one epoch in expectation, ``round(1/q)``.
    ``generator`` drives both
    the Poisson sampling and the noise; it must live on the parameters' device. The model
    must already be DP-compatible (``prepare_model``) and ``optimizer`` must optimise its
    parameters; violations raise UsageError rather than silently breaking the guarantee.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise UsageError(f"DP-SGD noise multiplier must be finite and >= 0, got {noise_multiplier}")
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise UsageError(f"DP-SGD max_grad_norm must be finite and > 0, got {max_grad_norm}")
    if not ModuleValidator.is_valid(model):
        raise UsageError("model has layers DP-SGD cannot handle (e.g. BatchNorm): build it "
                         "with privfedcal.privacy.dpsgd.prepare_model before the optimizer")
    own = {id(p) for p in model.parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if not opt_params or any(id(p) not in own for p in opt_params):
        raise UsageError("the optimizer must optimise the parameters of the model passed to "
                         "make_private_training (create it after prepare_model)")
    if sample_rate is None and expected_batch_size is None:
        q = dpsgd_sample_rate(batch_size, len(x))
        expected_batch_size = q * len(x)
    elif sample_rate is not None and expected_batch_size is not None:
        q = float(sample_rate)
        if not 0 < q <= 1 or not expected_batch_size > 0:
            raise UsageError(f"bad DP-SGD sample rate {q} or expected batch size "
                             f"{expected_batch_size}")
    else:
        raise UsageError("give DP-SGD's sample rate and expected batch size together")
    steps = max(1, round(1 / q)) if steps is None else int(steps)
    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    dp_opt = DPOptimizer(optimizer, noise_multiplier=noise_multiplier,
                         max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
                         loss_reduction="mean", generator=generator)
    loader = PoissonBatches(x, y, q, steps, generator)
    return PrivateTraining(model, dp_opt, loader, q, wrapped)
