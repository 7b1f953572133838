"""DSA (privfedcal/data/dsa.py): each transform on hand-made images against an independent
formula, the Siamese sharing (equal index, equal transform), differentiability."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privfedcal.data.dsa import (
    AUTHORS_STRATEGY,
    GROUPS,
    apply_transforms,
    draw_transforms,
    parse_strategy,
)
from privfedcal.errors import UsageError


def one(group: str, draws, n: int = 1) -> dict:
    """A parameter table of ``n`` identical sets choosing ``group`` with ``draws``."""
    t = {g: torch.zeros(n, *((3,) if g == "color" else (2,) if g in ("crop", "cutout", "scale")
                             else ())) for g in GROUPS}
    t[group] = torch.tensor(draws, dtype=torch.float32).expand(n, *t[group].shape[1:]).clone()
    t["group"] = torch.full((n,), GROUPS.index(group))
    return t


def f32(v: float) -> float:
    """``v`` as the float32 parameter table stores it (the reference must read the same)."""
    return float(torch.tensor(v, dtype=torch.float32))


def image(b=1, c=1, h=8, w=8, seed=0):
    return torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def test_flip_mirrors_the_columns_below_its_probability():
    x = torch.arange(6.0).view(1, 1, 2, 3)
    flipped = apply_transforms(x, one("flip", 0.2), torch.zeros(1))
    assert flipped.flatten().tolist() == [2, 1, 0, 5, 4, 3]
    assert torch.equal(apply_transforms(x, one("flip", 0.7), torch.zeros(1)), x)


def test_crop_translates_with_zeros_shifted_in():
    # 8 x 8: shifts in [-1, 1] (round(8/8)); draws 0.9 -> +1 rows, 0.1 -> -1 columns
    x = image()
    out = apply_transforms(x, one("crop", [0.9, 0.1]), torch.zeros(1))[0, 0]
    ref = torch.zeros(8, 8, dtype=x.dtype)
    for h in range(8):
        for w in range(8):
            if 0 <= h + 1 < 8 and 0 <= w - 1 < 8:
                ref[h, w] = x[0, 0, h + 1, w - 1]
    assert torch.equal(out, ref)
    assert torch.equal(apply_transforms(x, one("crop", [0.5, 0.5]), torch.zeros(1)), x)


def test_cutout_zeroes_one_square_of_half_the_side():
    # 8 x 8: a 4 x 4 square; centre choices 0..8 (9 of them, even side); draws pick row 2
    # (top 0) and column 8 (left 6: the square is cut by the border, columns 6..7)
    x = image() + 10.0
    out = apply_transforms(x, one("cutout", [2.5 / 9, 8.5 / 9]), torch.zeros(1))[0, 0]
    mask = torch.ones(8, 8, dtype=x.dtype)
    mask[0:4, 6:8] = 0
    assert torch.equal(out, x[0, 0] * mask)


def test_color_applies_brightness_saturation_contrast_in_order():
    x = image(c=3)
    b, s, c = 0.8, 0.3, 0.6
    out = apply_transforms(x, one("color", [b, s, c]), torch.zeros(1))
    b, s, c = f32(b), f32(s), f32(c)
    ref = x.numpy()[0] + (b - 0.5) * 1.0
    ref = (ref - ref.mean(axis=0, keepdims=True)) * (s * 2.0) + ref.mean(axis=0, keepdims=True)
    ref = (ref - ref.mean()) * (c + 0.5) + ref.mean()
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=1e-12, atol=1e-12)


def bilinear_affine(img: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Independent reference of an affine warp: output pixel (i, j) at normalised centre
    (u, v) = ((2j+1)/W - 1, (2i+1)/H - 1) reads ``a @ (u, v, 1)`` bilinearly, zeros outside."""
    h, w = img.shape
    out = np.zeros_like(img)

    def px(r, q):
        return img[r, q] if 0 <= r < h and 0 <= q < w else 0.0

    for i in range(h):
        for j in range(w):
            u, v = (2 * j + 1) / w - 1, (2 * i + 1) / h - 1
            sx, sy = a @ np.array([u, v, 1.0])
            fx, fy = ((sx + 1) * w - 1) / 2, ((sy + 1) * h - 1) / 2
            x0, y0 = math.floor(fx), math.floor(fy)
            dx, dy = fx - x0, fy - y0
            out[i, j] = ((1 - dx) * (1 - dy) * px(y0, x0) + dx * (1 - dy) * px(y0, x0 + 1)
                         + (1 - dx) * dy * px(y0 + 1, x0) + dx * dy * px(y0 + 1, x0 + 1))
    return out


def test_scale_is_an_axis_aligned_zoom():
    x = image(h=6, w=7)
    lo, hi = 1 / 1.2, 1.2
    r = [0.25, 0.9]
    sx, sy = (lo + f32(r[0]) * (hi - lo)), (lo + f32(r[1]) * (hi - lo))
    out = apply_transforms(x, one("scale", r), torch.zeros(1))[0, 0].numpy()
    ref = bilinear_affine(x[0, 0].numpy(), np.array([[sx, 0, 0], [0, sy, 0]]))
    np.testing.assert_allclose(out, ref, atol=1e-9)
    r1 = (1 - lo) / (hi - lo)  # a factor of 1 in both axes (up to float32): the identity
    assert torch.allclose(apply_transforms(x, one("scale", [r1, r1]), torch.zeros(1)), x)


def test_rotate_turns_by_at_most_fifteen_degrees():
    x = image(h=7, w=7)
    r = 0.85
    a = (f32(r) - 0.5) * 2 * 15 / 180 * math.pi
    out = apply_transforms(x, one("rotate", r), torch.zeros(1))[0, 0].numpy()
    rot = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0]])
    np.testing.assert_allclose(out, bilinear_affine(x[0, 0].numpy(), rot), atol=1e-9)
    assert torch.allclose(apply_transforms(x, one("rotate", 0.5), torch.zeros(1)), x)


def test_siamese_equal_index_equal_transform():
    """The Siamese property a match relies on: two batches (two sides of a match) augmented
    with the same parameter set get the same transform, image for image; the transform of an
    image depends on its set only, never on what else is in the batch."""
    g = torch.Generator().manual_seed(3)
    t = draw_transforms(40, AUTHORS_STRATEGY, g)
    a, b = image(b=40, c=3, h=8, w=8, seed=1), image(b=40, c=3, h=8, w=8, seed=2)
    idx = torch.arange(40)
    both = apply_transforms(torch.cat([a, b]), t, torch.cat([idx, idx]))
    assert torch.equal(both[:40], apply_transforms(a, t, idx))
    assert torch.equal(both[40:], apply_transforms(b, t, idx))
    # one set for a whole batch (the authors' class batch): reordering the batch reorders
    # the outputs, whatever the set's group (an image's position does not matter)
    same = torch.full((40,), 7)
    out_a, out_a2 = apply_transforms(a, t, same), apply_transforms(a.flip(0), t, same)
    assert torch.equal(out_a.flip(0), out_a2)
    # every group of the strategy is drawn
    assert set(t["group"].tolist()) == set(range(len(GROUPS)))


@pytest.mark.parametrize("group", GROUPS)
def test_every_transform_is_differentiable(group):
    x = image(b=2, c=3, h=5, w=5).requires_grad_(True)
    draws = {"color": [0.3, 0.6, 0.2], "crop": [0.9, 0.1], "cutout": [0.4, 0.7],
             "flip": 0.1, "scale": [0.2, 0.8], "rotate": 0.7}[group]
    t = one(group, draws, 2)
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    assert torch.autograd.gradcheck(lambda z: apply_transforms(z, t, torch.tensor([0, 1])), (x,))


def test_strategy_parsing():
    assert parse_strategy(AUTHORS_STRATEGY) == GROUPS
    assert parse_strategy("none") == () and parse_strategy("") == ()
    for bad in ("blur", "flip_flip", "color-crop"):
        with pytest.raises(UsageError):
            parse_strategy(bad)
    with pytest.raises(UsageError):
        apply_transforms(torch.zeros(3, 4), one("flip", 0.1), torch.zeros(3))
