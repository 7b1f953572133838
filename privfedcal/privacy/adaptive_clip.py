"""Adaptive clipping of the user-level DP updates (``--dp-adaptive-clip``).

Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with Adaptive
Clipping" (NeurIPS 2021), the geometric update of Algorithm 1: each participant also
reports whether its update norm is within the current clip ``C`` (a bit ``b_k``); the server
adds ``N(0, sigma_b^2)`` to the sum of the bits, divides by the public number of clients per
round ``m`` and moves the clip towards the target quantile ``gamma`` of the update norms:
``C <- C * exp(-eta (b_bar - gamma))`` (``eta`` = 0.2, the paper's default).

Privacy: one round releases the sum of clipped updates (sensitivity ``C``, noise
multiplier ``z_u``) and the noised count (sensitivity 1: one client's data present or
absent changes its bit by at most 1; an absent client's zero update is within any clip).
The two Gaussian releases together are a Gaussian mechanism of multiplier ``z`` with
``z^-2 = z_u^-2 + sigma_b^-2`` (their squared sensitivity-to-noise ratios add), so the
accountant charges ``z`` per round as without adaptation, and the updates' own multiplier
grows to ``z_u = (z^-2 - sigma_b^-2)^(-1/2)``. ``sigma_b`` is ``max(m / 20, z /
sqrt(0.1))``: the paper's ``m / 20`` where clients are many, and never more than a tenth of
the round's privacy (its ``1/z^2``) spent on the count, which costs the updates at most 5.4%
more noise. The new clip is post-processing of released values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privfedcal.errors import UsageError
from privfedcal.settings.messages import SettingError

#: the paper's learning rate of the geometric clip update
CLIP_LR = 0.2
#: the largest share of a round's privacy (its 1/z^2) that the count of clipped updates takes
COUNT_PRIVACY_SHARE = 0.1


def count_noise_std(noise_multiplier: float, clients_per_round: int) -> float:
    """``sigma_b``: the std of the noise on the count of updates within the clip."""
    return max(clients_per_round / 20.0, noise_multiplier / math.sqrt(COUNT_PRIVACY_SHARE))


def update_multiplier(noise_multiplier: float, count_std: float) -> float:
    """``z_u = (z^-2 - sigma_b^-2)^(-1/2)``: the updates' multiplier once the count takes
    its part of the round's privacy (refused where the count alone would exceed it)."""
    if not count_std > noise_multiplier:
        raise UsageError(f"the count's noise std {count_std:g} must exceed the round's noise "
                         f"multiplier {noise_multiplier:g}")
    return (noise_multiplier ** -2 - count_std ** -2) ** -0.5


@dataclass
class AdaptiveClip:
    """The clip's target quantile and its geometric update."""

    quantile: float = 0.5
    lr: float = CLIP_LR

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise SettingError(f"{{dp_clip_quantile}} must be in (0, 1), got {self.quantile}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"the clip's learning rate must be > 0, got {self.lr}")

    def next_clip(self, clip: float, noisy_fraction: float) -> float:
        """``C exp(-eta (b_bar - gamma))``: grows when fewer than the quantile were within."""
        return clip * math.exp(-self.lr * (noisy_fraction - self.quantile))


__all__ = ["CLIP_LR", "COUNT_PRIVACY_SHARE", "AdaptiveClip", "count_noise_std",
           "update_multiplier"]
