"""Image and feature metrics, pinned on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.attacks.reconstruction.metrics import (
    best_match,
    default_ssim_window,
    feature_cosine,
    matched_psnr,
    nearest_is_true,
    normalise,
    psnr,
    ssim,
)
from privfedcal.errors import UsageError


def _imgs(seed: int, n: int = 3, c: int = 1, side: int = 8) -> torch.Tensor:
    return torch.rand(n, c, side, side, generator=torch.Generator().manual_seed(seed))


def test_identical_images_psnr_inf_and_ssim_one():
    x = _imgs(0)
    assert torch.isinf(psnr(x, x)).all()
    assert torch.allclose(ssim(x, x), torch.ones(3), atol=1e-6)


def test_psnr_of_constant_offset_is_hand_value():
    x = 0.2 + 0.6 * _imgs(1)
    # mse = 0.05^2 = 0.0025 -> 10 log10(1 / 0.0025) = 10 log10(400) = 26.0206 dB
    assert torch.allclose(psnr(x + 0.05, x), torch.full((3,), 10 * math.log10(400.0)), atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3))
def test_psnr_matches_numpy_and_is_symmetric(seed, channels):
    x, y = _imgs(seed, c=channels), _imgs(seed + 1, c=channels)
    mse = ((x.numpy().astype(np.float64) - y.numpy()) ** 2).reshape(3, -1).mean(1)
    expected = 10 * np.log10(1.0 / mse)
    assert np.allclose(psnr(x, y).numpy(), expected, atol=1e-4)
    assert torch.allclose(psnr(x, y), psnr(y, x))


def test_ssim_of_two_constant_images_is_the_luminance_term():
    # Constant images have zero variance and covariance: SSIM = (2ab + C1) / (a^2 + b^2 + C1),
    # C1 = (0.01 * data_range)^2, the contrast/structure term being C2 / C2 = 1.
    a, b, c1 = 0.3, 0.7, 0.01**2
    x, y = torch.full((1, 1, 8, 8), a), torch.full((1, 1, 8, 8), b)
    assert ssim(x, y).item() == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), abs=1e-5)


def test_ssim_window_choice_and_validation():
    assert default_ssim_window(8, 8) == 3
    assert default_ssim_window(16, 20) == 7
    assert default_ssim_window(32, 32) == 11
    x = _imgs(2)
    assert ssim(x, x, kernel_size=5).shape == (3,)
    with pytest.raises(UsageError):
        ssim(x, x, kernel_size=4)
    with pytest.raises(UsageError):
        psnr(x, _imgs(2, side=4))


def test_ssim_is_lower_for_noisier_images():
    x = _imgs(3)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    small, large = (x + 0.05 * noise).clamp(0, 1), (x + 0.3 * noise).clamp(0, 1)
    assert (ssim(small, x) > ssim(large, x)).all()


def test_best_match_and_nearest_is_true():
    cands = _imgs(4, n=5)
    rec = cands[[3, 1]] + 0.01
    idx, val = best_match(rec, cands)
    assert idx.tolist() == [3, 1]
    assert torch.allclose(val, psnr(rec, cands[[3, 1]]), atol=1e-4)
    assert nearest_is_true(rec, cands, torch.tensor([3, 0])) == pytest.approx(0.5)


def test_matched_psnr_finds_the_permutation():
    truth = _imgs(5, n=3)
    rec = truth[[2, 0, 1]]
    val, index = matched_psnr(rec, truth)
    assert index.tolist() == [2, 0, 1]
    assert torch.isinf(val).all()


def test_feature_cosine_normalises_pixels_first():
    class Flat(torch.nn.Module):
        training = False

        def features(self, x):
            return x.flatten(1)

    x = _imgs(6, n=2, side=4)
    target = normalise(x, [0.5], [0.25]).flatten(1)
    cos = feature_cosine(Flat(), x, target, mean=[0.5], std=[0.25])
    assert torch.allclose(cos, torch.ones(2), atol=1e-6)
    raw = feature_cosine(Flat(), x, target)  # no normalisation: features differ
    assert (raw < 0.999).all()
