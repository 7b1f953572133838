"""Batched crop + flip against a naive per-sample loop replaying the same draws."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.data import augment_batch
from privfedcal.errors import UsageError

torch.set_num_threads(1)


def naive(x: torch.Tensor, seed: int, padding: int, flip: bool) -> torch.Tensor:
    """Replays the documented draw order (row offsets, column offsets, then flips)."""
    g = torch.Generator().manual_seed(seed)
    b, _, h, w = x.shape
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=g)
    flips = torch.rand(b, generator=g) < 0.5 if flip else torch.zeros(b, dtype=torch.bool)
    padded = F.pad(x, (padding,) * 4)
    out = []
    for i in range(b):
        oy, ox = int(offsets[0, i]), int(offsets[1, i])
        window = padded[i, :, oy:oy + h, ox:ox + w]
        out.append(window.flip(-1) if flips[i] else window)
    return torch.stack(out)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 5), c=st.integers(1, 3), h=st.integers(1, 6), w=st.integers(1, 6),
       padding=st.integers(0, 3), flip=st.booleans(), seed=st.integers(0, 2**31))
def test_matches_naive_loop(b, c, h, w, padding, flip, seed):
    x = torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(seed))
    out = augment_batch(x, torch.Generator().manual_seed(seed), padding=padding, flip=flip)
    assert out.shape == x.shape and out.dtype == x.dtype
    if padding == 0 and not flip:
        assert torch.equal(out, x)  # identity
    else:
        assert torch.equal(out, naive(x, seed, padding, flip))


def test_crop_is_a_shifted_window_with_zero_border():
    x = torch.arange(1, 17, dtype=torch.float32).view(1, 1, 4, 4).repeat(64, 1, 1, 1)
    out = augment_batch(x, torch.Generator().manual_seed(0), padding=2, flip=False)
    padded = F.pad(x[:1], (2, 2, 2, 2))[0, 0]
    windows = {tuple(padded[i:i + 4, j:j + 4].flatten().tolist()) for i in range(5) for j in range(5)}
    seen = {tuple(o.flatten().tolist()) for o in out}
    assert seen <= windows and len(seen) > 5  # every crop is one of the 25 shifted windows


def test_flip_only_and_determinism():
    x = torch.randn(64, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    out = augment_batch(x, torch.Generator().manual_seed(2), padding=0, flip=True)
    same = (out == x).flatten(1).all(1)
    flipped = (out == x.flip(-1)).flatten(1).all(1)
    assert (same | flipped).all() and same.any() and flipped.any()
    again = augment_batch(x, torch.Generator().manual_seed(2), padding=0, flip=True)
    other = augment_batch(x, torch.Generator().manual_seed(3), padding=0, flip=True)
    assert torch.equal(out, again) and not torch.equal(out, other)


def test_bad_inputs():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(UsageError, match="B, C, H, W"):
        augment_batch(torch.zeros(3, 4, 4), g)
    with pytest.raises(UsageError, match="padding"):
        augment_batch(torch.zeros(1, 1, 4, 4), g, padding=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    cpu = augment_batch(x, torch.Generator().manual_seed(5))
    gpu = augment_batch(x.cuda(), torch.Generator().manual_seed(5))
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
