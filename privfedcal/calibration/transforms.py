"""ReLU + Tukey's power transform, CCVR sec. 5.1 (Luo et al., NeurIPS 2021; lambda = 0.5).

CCVR applies ``relu`` then ``z ** lambda`` to make features "more Gaussian-like" before fitting
the class Gaussians. The classifier re-trained on such features only makes sense on features
transformed the same way, so a calibrator that uses it returns it from
``feature_transform()`` and the simulator applies it at inference.

Tukey's ladder maps lambda = 0 to the logarithm; after the ReLU many entries are exactly zero,
so ours is ``log(relu(z) + eps)`` (eps = 1e-6) for lambda = 0, a finite stand-in for log 0.
Negative lambda would send zeros to infinity and is refused.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from privfedcal.errors import UsageError

LOG_EPS = 1e-6


def relu_tukey(z: Tensor, lam: float = 0.5) -> Tensor:
    """``relu(z) ** lam`` (``log(relu(z) + 1e-6)`` when ``lam == 0``)."""
    if not math.isfinite(lam) or lam < 0:
        raise UsageError(f"Tukey lambda must be a finite number >= 0, got {lam}")
    z = torch.relu(z)
    if lam == 0:
        return torch.log(z + LOG_EPS)
    if lam == 1:
        return z
    return z.pow(lam)
