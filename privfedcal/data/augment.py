"""Batched crop-and-flip augmentation (the CIFAR recipe of the CCVR/MOON/CReFF code).

Random crop with ``padding`` zero pixels on every side (applied to normalised images, so
the padding is the channel mean) and a random horizontal flip, for a whole batch at once:
pad once, draw per-sample offsets and flips from a CPU generator (a whole epoch at once in
local training), gather rows then columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.errors import UsageError


def augment_batch(x: Tensor, generator: torch.Generator, *, padding: int = 4,
                  flip: bool = True) -> Tensor:
    """A new (B, C, H, W) batch: each image randomly cropped from its padding and maybe flipped.

    Deterministic for the generator's state. Offsets are drawn first (rows then columns),
    then the flips (only when ``flip``), on the generator's device, then moved to ``x``'s.
    """
    _check(x, padding)
    if padding == 0 and not flip:
        return x.clone()
    draws = draw_augmentation(x.shape[0], generator, padding=padding, flip=flip)
    return apply_augmentation(x, tuple(d.to(x.device) for d in draws), padding=padding)


def draw_augmentation(n: int, generator: torch.Generator, *, padding: int = 4,
                      flip: bool = True) -> tuple[Tensor, ...]:
    """The random draws of ``augment_batch`` for ``n`` images, on the generator's device:
    ``(offsets,)`` of shape (2, n) (rows then columns) or ``(offsets, flipped)`` with
    ``flip``. Local training draws a whole epoch at once and moves it to the compute device
    in one copy, so no training step waits on a host-to-device transfer."""
    gen_device = generator.device
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=generator, device=gen_device)
    if not flip:
        return (offsets,)
    return offsets, torch.rand(n, generator=generator, device=gen_device) < 0.5


def apply_augmentation(x: Tensor, draws: tuple[Tensor, ...], *, padding: int = 4) -> Tensor:
    """Crop (and flip) the batch ``x`` with ``draws`` (from ``draw_augmentation``, one entry
    per image of ``x``, on ``x``'s device)."""
    b, c, h, w = x.shape
    offsets = draws[0]
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)  # (B, H) into padded rows
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)  # (B, W) into padded cols
    if len(draws) > 1:
        cols = torch.where(draws[1][:, None], cols.flip(-1), cols)
    padded = F.pad(x, (padding,) * 4) if padding else x
    wp = padded.shape[-1]
    out = padded.gather(2, rows[:, None, :, None].expand(b, c, h, wp))
    return out.gather(3, cols[:, None, None, :].expand(b, c, h, w))


def _check(x: Tensor, padding: int) -> None:
    if x.ndim != 4:
        raise UsageError(f"augment_batch expects (B, C, H, W) images, got shape {tuple(x.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise UsageError(f"padding must be an integer >= 0, got {padding}")
