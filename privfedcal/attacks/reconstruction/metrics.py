"""How close a reconstruction is to the data it came from.

Image metrics work on pixel images in [0, 1] of shape (B, C, H, W) and return one value
per image: PSNR (``10 log10(1 / MSE)``, data range 1) and SSIM (Wang et al. 2004) through
torchmetrics. Tiny images (8x8 digits) need a small SSIM window; ``ssim`` picks one from the
image size unless told. ``feature_cosine`` measures what the attacker optimised (agreement
in feature space); ``best_match`` / ``matched_psnr`` / ``nearest_is_true`` say whether a
reconstruction singles out the true training image among candidates. LPIPS is left out: it
needs downloaded network weights, which privfedcal never fetches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import Tensor
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)

from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier


def _as_batch(x: Tensor, name: str) -> Tensor:
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4:
        raise UsageError(
            f"{name} must be an image (C,H,W) or a batch (B,C,H,W), got {tuple(x.shape)}"
        )
    return x


def _pair(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    x, y = _as_batch(x, "x"), _as_batch(y, "y")
    if x.shape[1:] != y.shape[1:]:
        raise UsageError(f"image shapes differ: {tuple(x.shape[1:])} vs {tuple(y.shape[1:])}")
    x, y = torch.broadcast_tensors(x.double(), y.double())
    return x, y


def psnr(x: Tensor, y: Tensor) -> Tensor:
    """Per-image PSNR in dB of [0,1] images (inf for identical images)."""
    x, y = _pair(x, y)
    return peak_signal_noise_ratio(x, y, data_range=1.0, reduction="none", dim=(1, 2, 3)).float()


def default_ssim_window(height: int, width: int) -> int:
    """Our choice of SSIM window: 11 (the standard) from 32 px, 7 from 16 px, else 3."""
    side = min(height, width)
    return 11 if side >= 32 else 7 if side >= 16 else 3


def ssim(x: Tensor, y: Tensor, *, kernel_size: int | None = None) -> Tensor:
    """Per-image SSIM of [0,1] images (1 for identical images)."""
    x, y = _pair(x, y)
    k = kernel_size if kernel_size is not None else default_ssim_window(x.shape[-2], x.shape[-1])
    if k < 1 or k % 2 == 0 or k > min(x.shape[-2:]):
        raise UsageError(f"SSIM kernel_size must be odd and at most the image side, got {k}")
    val = structural_similarity_index_measure(x, y, data_range=1.0, kernel_size=k, reduction="none")
    # a tuple only with return_full_image / return_contrast_sensitivity, not asked for here
    return cast(Tensor, val).float()


def normalise(
    pixels: Tensor, mean: Sequence[float] | Tensor, std: Sequence[float] | Tensor
) -> Tensor:
    """Pixel space [0,1] -> the model's normalised input space ``(p - mean) / std``."""
    m = torch.as_tensor(mean, dtype=pixels.dtype, device=pixels.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=pixels.dtype, device=pixels.device).view(1, -1, 1, 1)
    return (pixels - m) / s


def feature_cosine(
    model: FeatureClassifier,
    x_rec: Tensor,
    z_target: Tensor,
    *,
    mean: Sequence[float] | Tensor | None = None,
    std: Sequence[float] | Tensor | None = None,
) -> Tensor:
    """Cosine between ``model.features`` of the reconstructions and the target features.

    ``x_rec`` is (B,C,H,W) in pixel space when ``mean``/``std`` are given (normalised first),
    else already in the model's input space; ``z_target`` is (d,) or (B, d).
    """
    x_rec = _as_batch(x_rec, "x_rec")
    if (mean is None) != (std is None):
        raise UsageError("give both mean and std, or neither")
    if mean is not None and std is not None:
        x_rec = normalise(x_rec, mean, std)
    with eval_mode(model), torch.no_grad():
        z = model.features(x_rec)
    return F.cosine_similarity(z, z_target.to(z.dtype).expand_as(z), dim=-1)


def _mse_matrix(rec: Tensor, candidates: Tensor) -> Tensor:
    """(B, N) mean squared error between every reconstruction and every candidate."""
    a = _as_batch(rec, "rec").flatten(1).double()
    b = _as_batch(candidates, "candidates").flatten(1).double()
    if a.shape[1] != b.shape[1]:
        raise UsageError("reconstructions and candidates have different image shapes")
    return torch.cdist(a, b).pow(2) / a.shape[1]


def _psnr_from_mse(mse: Tensor) -> Tensor:
    return (10.0 * torch.log10(1.0 / mse)).float()


def best_match(rec: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """For each reconstruction, the candidate (e.g. the client's true images of that class)
    with the highest PSNR: returns ``(index, psnr)``, each of shape (B,)."""
    mse = _mse_matrix(rec, candidates)
    best = mse.argmin(dim=1)
    return best, _psnr_from_mse(mse.gather(1, best[:, None]).squeeze(1))


def matched_psnr(rec: Tensor, truth: Tensor) -> tuple[Tensor, Tensor]:
    """PSNR after the best one-to-one assignment of reconstructions to true images
    (Hungarian on MSE; a batch attack recovers a set, so order is meaningless).

    Returns ``(psnr, index)`` of shape (B,): ``index[i]`` is the true image assigned to
    reconstruction ``i``. Needs B <= N.
    """
    mse = _mse_matrix(rec, truth)
    if mse.shape[0] > mse.shape[1]:
        raise UsageError("matched_psnr needs at most as many reconstructions as true images")
    rows, cols = linear_sum_assignment(mse.cpu().numpy())
    index = torch.empty(mse.shape[0], dtype=torch.long)
    index[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
    return _psnr_from_mse(mse[torch.arange(mse.shape[0]), index.to(mse.device)]), index


def nearest_is_true(rec: Tensor, train_images: Tensor, true_index: Tensor) -> float:
    """Fraction of reconstructions whose nearest training image (MSE) is the true one."""
    mse = _mse_matrix(rec, train_images)
    true_index = torch.as_tensor(true_index, device=mse.device).reshape(-1)
    if true_index.numel() != mse.shape[0]:
        raise UsageError("need one true index per reconstruction")
    return float((mse.argmin(dim=1) == true_index).double().mean())
