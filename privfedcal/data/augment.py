"""Batched crop-and-flip augmentation (the CIFAR recipe of the CCVR/MOON/CReFF code).

Random crop with ``padding`` zero pixels on every side (applied to normalised images, so
the padding is the channel mean) and a random horizontal flip, for a whole batch at once:
pad once, draw per-sample offsets and flips from a CPU generator, gather rows then columns.
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
    if x.ndim != 4:
        raise UsageError(f"augment_batch expects (B, C, H, W) images, got shape {tuple(x.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise UsageError(f"padding must be an integer >= 0, got {padding}")
    b, c, h, w = x.shape
    if padding == 0 and not flip:
        return x.clone()
    gen_device = generator.device
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=generator, device=gen_device)
    offsets = offsets.to(x.device)
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)  # (B, H) into padded rows
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)  # (B, W) into padded cols
    if flip:
        flipped = torch.rand(b, generator=generator, device=gen_device).to(x.device) < 0.5
        cols = torch.where(flipped[:, None], cols.flip(-1), cols)
    padded = F.pad(x, (padding,) * 4) if padding else x
    wp = padded.shape[-1]
    out = padded.gather(2, rows[:, None, :, None].expand(b, c, h, wp))
    return out.gather(3, cols[:, None, None, :].expand(b, c, h, w))
