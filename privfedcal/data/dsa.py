"""Differentiable Siamese augmentation (DSA; Zhao & Bilen, ICML 2021), as CReFF's code uses it.

DSA draws ONE set of transform parameters and applies it to several images at once
("Siamese"): in dataset condensation to the real and the synthetic batch of a match, in
CReFF's code (``shangxinyi/CReFF-FL``) to every image of a class batch whose classifier
gradient a client computes (its server matches 256-d federated features, which are not
images, so nothing is augmented there). Every transform is differentiable in the images.

The strategy is a ``_``-joined list of transform groups; per parameter set one group is
picked uniformly (the authors' single mode ``'S'``) and applied:

* ``color``: brightness ``x + (b - 1/2) * 1.0``, then saturation ``(x - m_c) * 2.0 s + m_c``
  (``m_c`` the mean over channels), then contrast ``(x - m) * (c + 0.5) + m`` (``m`` the
  image mean); ``b, s, c ~ U(0, 1)``;
* ``crop``: a translation by integers in ``[-s, s]`` rows and columns, ``s = round(H/8)``,
  zeros shifted in;
* ``cutout``: a square of side ``round(H/2)`` set to zero, centred at a uniform pixel;
* ``flip``: a horizontal flip with probability 1/2;
* ``scale``: ``x`` and ``y`` scaled by factors in ``[1/1.2, 1.2]`` (bilinear, zeros outside);
* ``rotate``: a rotation by an angle in ``[-15, 15]`` degrees (bilinear, zeros outside).

``draw_transforms`` draws ``n`` parameter sets from a generator (data-independent);
``apply_transforms(x, t, index)`` augments image ``i`` with set ``index[i]``, so images with
the same index get the same transform. Our own batched code, written from the definitions
above (the authors' ratios, ``ParamDiffAug``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.errors import UsageError

#: the authors' strategy (the ``--dsa_strategy`` option of CReFF-FL's code)
AUTHORS_STRATEGY = "color_crop_cutout_flip_scale_rotate"
GROUPS = ("color", "crop", "cutout", "flip", "scale", "rotate")


@dataclass(frozen=True)
class DSARatios:
    """The authors' transform ranges (CReFF-FL ``ParamDiffAug``)."""

    flip_prob: float = 0.5
    scale: float = 1.2
    rotate_degrees: float = 15.0
    crop_pad: float = 0.125
    cutout: float = 0.5
    brightness: float = 1.0
    saturation: float = 2.0
    contrast: float = 0.5


def parse_strategy(strategy: str) -> tuple[str, ...]:
    """The groups of ``strategy`` (``"none"`` or ``""``: no augmentation, an empty tuple)."""
    if strategy in ("none", ""):
        return ()
    groups = tuple(strategy.split("_"))
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or len(set(groups)) != len(groups):
        raise UsageError(f"DSA strategy {strategy!r}: groups must be distinct names among "
                         f"{', '.join(GROUPS)} joined by '_' (or 'none')")
    return groups


def draw_transforms(n: int, strategy: str, generator: torch.Generator) -> dict[str, Tensor]:
    """``n`` parameter sets on the generator's device: ``group`` (index into ``GROUPS``) and
    every group's uniform draws (only the chosen group's are used). The draws are the same
    whatever the images, so augmenting cannot make one sample's transform depend on others."""
    groups = parse_strategy(strategy)
    if not groups:
        raise UsageError("draw_transforms needs a strategy with at least one group")
    dev = generator.device

    def u(*shape: int) -> Tensor:
        return torch.rand(n, *shape, generator=generator, device=dev)

    chosen = torch.randint(0, len(groups), (n,), generator=generator, device=dev)
    return {"group": torch.tensor([GROUPS.index(g) for g in groups], device=dev)[chosen],
            "color": u(3), "crop": u(2), "cutout": u(2), "flip": u(), "scale": u(2),
            "rotate": u()}


def apply_transforms(x: Tensor, t: dict[str, Tensor], index: Tensor, *,
                     ratios: DSARatios = DSARatios()) -> Tensor:
    """Images ``x`` (B, C, H, W), image ``i`` augmented by parameter set ``index[i]`` of ``t``
    (``draw_transforms``): equal indices, equal transforms. Differentiable in ``x``."""
    if x.ndim != 4:
        raise UsageError(f"DSA expects (B, C, H, W) images, got shape {tuple(x.shape)}")
    index = index.to(x.device, torch.long)
    p = {k: v.to(x.device)[index] for k, v in t.items()}
    out = x
    for g, fn in enumerate((_color, _crop, _cutout, _flip, _scale, _rotate)):
        rows = torch.nonzero(p["group"] == g).flatten()
        if len(rows):
            part = fn(x[rows], p[GROUPS[g]][rows].to(x.dtype), ratios)
            out = out.index_copy(0, rows, part.to(out.dtype))
    return out


def _color(x: Tensor, r: Tensor, k: DSARatios) -> Tensor:
    x = x + ((r[:, 0] - 0.5) * k.brightness).view(-1, 1, 1, 1)
    m = x.mean(dim=1, keepdim=True)
    x = (x - m) * (r[:, 1] * k.saturation).view(-1, 1, 1, 1) + m
    m = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - m) * (r[:, 2] + k.contrast).view(-1, 1, 1, 1) + m


def _crop(x: Tensor, r: Tensor, k: DSARatios) -> Tensor:
    """out[h, w] = x[h + dh, w + dw] inside the image, 0 outside (one zero border, clamped)."""
    b, c, h, w = x.shape
    sh, sw = int(h * k.crop_pad + 0.5), int(w * k.crop_pad + 0.5)
    dh = (r[:, 0] * (2 * sh + 1)).long().clamp(max=2 * sh) - sh
    dw = (r[:, 1] * (2 * sw + 1)).long().clamp(max=2 * sw) - sw
    rows = (torch.arange(h, device=x.device) + dh[:, None] + 1).clamp(0, h + 1)   # (B, H)
    cols = (torch.arange(w, device=x.device) + dw[:, None] + 1).clamp(0, w + 1)   # (B, W)
    padded = F.pad(x, (1, 1, 1, 1))
    out = padded.gather(2, rows[:, None, :, None].expand(b, c, h, w + 2))
    return out.gather(3, cols[:, None, None, :].expand(b, c, h, w))


def _cutout(x: Tensor, r: Tensor, k: DSARatios) -> Tensor:
    b, _, h, w = x.shape
    ch, cw = int(h * k.cutout + 0.5), int(w * k.cutout + 0.5)
    ch_range, cw_range = h + (1 - ch % 2), w + (1 - cw % 2)   # the centre's choices (authors)
    top = (r[:, 0] * ch_range).long().clamp(max=ch_range - 1) - ch // 2
    left = (r[:, 1] * cw_range).long().clamp(max=cw_range - 1) - cw // 2
    hh, ww = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
    in_h = (hh >= top[:, None]) & (hh < top[:, None] + ch)          # (B, H)
    in_w = (ww >= left[:, None]) & (ww < left[:, None] + cw)        # (B, W)
    keep = ~(in_h[:, :, None] & in_w[:, None, :])
    return x * keep[:, None].to(x.dtype)


def _flip(x: Tensor, r: Tensor, k: DSARatios) -> Tensor:
    return torch.where((r < k.flip_prob).view(-1, 1, 1, 1), x.flip(3), x)


def _affine(x: Tensor, theta: Tensor) -> Tensor:
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _scale(x: Tensor, r: Tensor, k: DSARatios) -> Tensor:
    s = r * (k.scale - 1.0 / k.scale) + 1.0 / k.scale                 # (B, 2): sx, sy
    theta = torch.zeros(len(x), 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 1, 1] = s[:, 0], s[:, 1]
    return _affine(x, theta)


def _rotate(x: Tensor, r: Tensor, k: DSARatios) -> Tensor:
    a = (r - 0.5) * 2 * k.rotate_degrees / 180 * math.pi
    cos, sin = torch.cos(a), torch.sin(a)
    theta = torch.stack([torch.stack([cos, -sin, torch.zeros_like(a)], 1),
                         torch.stack([sin, cos, torch.zeros_like(a)], 1)], 1)
    return _affine(x, theta)


__all__ = ["AUTHORS_STRATEGY", "GROUPS", "DSARatios", "apply_transforms", "draw_transforms",
           "parse_strategy"]
