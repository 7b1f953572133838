"""A model update as one flat float64 vector: its layout, norm, clip and Gaussian noise.

DP-FedAvg (privacy/user_dp.py) lays the floating entries of each update end to end in one
float64 vector (``UpdateLayout``): the norm, the clip, the noise and the sum are one
operation each on it, not one per entry. float64 keeps the clip exact to the last bits of a
float32 model and the sum of hundreds of clipped updates free of float32 rounding. The
noise is drawn in float64 too: torch draws float32 normals from 24-bit uniforms, so their
tails stop near 5.8 standard deviations (Box-Muller's largest radius, ``sqrt(2 ln 2^24)``),
while the Gaussian mechanism's guarantee assumes the whole tail; float64 draws reach beyond
8 standard deviations, a truncation far below any delta used here, and the draw is once per
round on the server (about a millisecond for 50,000 coordinates). The entries' forms
(``model_delta``, ``update_norm``, ``clip_update``, ``gaussian_noise``) give the same numbers
on a state dict, for tests and the audit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.update_stage import State


def floating_keys(state: State) -> list[str]:
    """The entries an update carries: every floating-point tensor (integer buffers such as
    BatchNorm's counters are not averaged under DP and keep the global value)."""
    return [k for k, v in state.items() if v.is_floating_point()]


def model_delta(state: State, reference: State) -> State:
    """``state - reference`` on the floating entries, in float64."""
    return {k: state[k].detach().to(torch.float64) - reference[k].detach().to(torch.float64)
            .to(state[k].device) for k in floating_keys(reference)}


def update_norm(delta: State) -> float:
    """The L2 norm of the whole update (every entry flattened into one vector)."""
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in delta.values()))


def vector_norm(delta: Tensor) -> float:
    """The L2 norm of a flat float64 update. Its square cannot overflow (a float32 entry's
    square is below 1e78), so it is finite exactly when every entry is."""
    return float(torch.linalg.vector_norm(delta))


def clip_factor(norm: float, clip: float) -> float:
    """``min(1, S / ||delta||)``: the factor that scales an update of norm ``norm`` into the
    ball of radius ``clip`` (1 for an update already inside)."""
    if not (math.isfinite(clip) and clip > 0):
        raise UsageError(f"update clip must be a finite number > 0, got {clip}")
    return 1.0 if norm <= clip else clip / norm


def clip_update(delta: State, clip: float) -> State:
    """``delta * min(1, S / ||delta||)``: the whole update scaled into the ball of radius
    ``clip``; an update already inside comes back unchanged."""
    factor = clip_factor(update_norm(delta), clip)
    if factor == 1.0:
        return dict(delta)
    return {k: v * factor for k, v in delta.items()}


def gaussian_vector(n: int, std: float, generator: torch.Generator) -> Tensor:
    """``n`` independent ``N(0, std^2)`` draws in float64, on the generator's device."""
    return torch.randn(n, generator=generator, dtype=torch.float64,
                       device=generator.device).mul_(std)


def gaussian_noise(like: State, std: float, generator: torch.Generator) -> State:
    """Independent ``N(0, std^2)`` for every coordinate of ``like`` (float64): one
    ``gaussian_vector`` split into ``like``'s entries in their order, so a flat update of
    the same layout gets the same draws from the same generator."""
    sizes = [v.numel() for v in like.values()]
    flat = gaussian_vector(sum(sizes), std, generator)
    return {k: piece.view(v.shape).to(v.device)
            for (k, v), piece in zip(like.items(), flat.split(sizes), strict=True)}


class UpdateLayout:
    """Where each floating entry of a model state sits in one flat float64 vector (the
    entries in the reference state's order), and the way back to entries."""

    def __init__(self, reference: State) -> None:
        self.keys = floating_keys(reference)
        self.shapes = [reference[k].shape for k in self.keys]
        self.sizes = [reference[k].numel() for k in self.keys]
        self.dtypes = [reference[k].dtype for k in self.keys]
        self.device = reference[self.keys[0]].device if self.keys else torch.device("cpu")
        self.numel = sum(self.sizes)

    def flatten(self, state: State, out: Tensor | None = None) -> Tensor:
        """``state``'s entries end to end in float64 (written into ``out`` when given)."""
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float64, device=self.device)
        for piece, key, shape in zip(out.split(self.sizes), self.keys, self.shapes,
                                     strict=True):
            piece.view(shape).copy_(state[key].detach())
        return out

    def unflatten(self, flat: Tensor, cast: bool = False) -> State:
        """The entries of ``flat``: views of it, or (``cast``) copies in each entry's own
        dtype that no later change of ``flat`` reaches."""
        return {key: (piece.view(shape).to(dtype, copy=True) if cast else piece.view(shape))
                for piece, key, shape, dtype in zip(flat.split(self.sizes), self.keys,
                                                    self.shapes, self.dtypes, strict=True)}



def moved_state(global_state: State, layout: UpdateLayout, base: Tensor, total: Tensor,
                denominator: int) -> State:
    """The new global state: ``global + total / m`` in float64 (``base``: the global state
    flattened by ``layout``; ``m``: ``denominator``; integer buffers: the global ones).
    BatchNorm running variances are clamped at 0 after the noise (post-processing: the
    guarantee is unchanged, and a negative variance would make evaluation NaN)."""
    new = total.div(denominator).add_(base)
    out = dict(global_state)
    for k, v in layout.unflatten(new).items():
        if k.endswith("running_var"):
            v = v.clamp_min(0.0)
        out[k] = v.to(global_state[k].dtype, copy=True)
    return out


__all__ = ["UpdateLayout", "clip_factor", "clip_update", "floating_keys",
           "gaussian_noise", "gaussian_vector", "model_delta", "moved_state", "update_norm",
           "vector_norm"]
