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

An update stage of its own ("adaptive-clip" in privacy/stage_registry.py, planned where the
user-DP plan names a target quantile, placed before "dp-fedavg"): it has no halves and keeps
no state (the clip it moves is DP-FedAvg's, saved in DP-FedAvg's checkpoint entry); its
``join`` hands it to the run's DP-FedAvg stage as that stage's clip policy
(``ClipPolicy``, privacy/dp_fedavg_round.py), whose hooks it implements: DP-FedAvg calls
them for the multiplier split, the count after each round and the summary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from privfedcal.errors import UsageError
from privfedcal.privacy.dp_fedavg_round import RoundStage
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.release_journal import SERVER
from privfedcal.privacy.update_stage import UpdateStage
from privfedcal.privacy.user_dp import UserDP
from privfedcal.settings.messages import SettingError

#: the paper's learning rate of the geometric clip update
CLIP_LR = 0.2
#: the largest share of a round's privacy (its 1/z^2) that the count of clipped updates takes
COUNT_PRIVACY_SHARE = 0.1
#: the noise generator's stream of the count (DP-FedAvg's: 301 the shares, 302 the sum)
COUNT_STREAM = 303


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
class AdaptiveClip(UpdateStage):
    """The clip's target quantile and its geometric update: the "adaptive-clip" update
    stage, and DP-FedAvg's clip policy once joined to it (module docstring)."""

    quantile: float = 0.5
    lr: float = CLIP_LR
    name = "adaptive-clip"

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise SettingError(f"{{dp_clip_quantile}} must be in (0, 1), got {self.quantile}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"the clip's learning rate must be > 0, got {self.lr}")

    def next_clip(self, clip: float, noisy_fraction: float) -> float:
        """``C exp(-eta (b_bar - gamma))``: grows when fewer than the quantile were within."""
        return clip * math.exp(-self.lr * (noisy_fraction - self.quantile))

    # ---- the update stage: joins DP-FedAvg -------------------------------------------------
    def join(self, stages: list[UpdateStage]) -> None:
        """Become the clip policy of the run's DP-FedAvg stage (refused without one)."""
        targets = [s for s in stages if isinstance(s, UserDP)]
        if not targets:
            raise SettingError("{dp_adaptive_clip} moves the clip of {dp_updates}: a run "
                               "without it plans no DP-FedAvg stage")
        for stage in targets:
            stage.use_clip_policy(self)

    # ---- DP-FedAvg's clip policy (privacy/dp_fedavg_round.py ClipPolicy) -------------------
    def check(self, stage: RoundStage) -> None:
        """Central noise only: the server must count the updates within the clip."""
        if stage.distributed:
            raise SettingError("{dp_adaptive_clip} runs with central noise only: under "
                               "{secagg_updates} its count would leave the ciphertexts")

    def count_std(self, stage: RoundStage) -> float:
        return count_noise_std(stage.noise_multiplier, stage.denominator)

    def update_multiplier(self, stage: RoundStage) -> float:
        return update_multiplier(stage.noise_multiplier, self.count_std(stage))

    def moved_clip(self, stage: RoundStage, within: int, round_: int) -> float:
        """The count of the round's updates within the clip, noised (journaled as the
        release ``<label>/count``, charged with the round), and the clip moved by it."""
        g = noise_generator(stage.seed, round_, -1, COUNT_STREAM, seeded=stage.seeded)
        count = within + self.count_std(stage) * torch.randn((1,), generator=g,
                                                             dtype=torch.float64)
        noisy = float(stage.released(round_, f"{stage.label}/count", SERVER, count))
        return self.next_clip(stage.clip, noisy / stage.denominator)

    def clip_summary(self, stage: RoundStage) -> dict[str, Any]:
        """The ``adaptive_clip`` entry of the run's ``user_dp`` summary."""
        return {"quantile": self.quantile, "lr": self.lr, "initial_clip": stage.initial_clip,
                "count_noise_std": self.count_std(stage),
                "update_noise_multiplier": stage.update_multiplier}

    def describe(self, stage: RoundStage) -> str:
        return (f"adaptive update clip ({stage.initial_clip:g} -> {stage.clip:.4g}, quantile "
                f"{self.quantile:g})")


__all__ = ["CLIP_LR", "COUNT_PRIVACY_SHARE", "COUNT_STREAM", "AdaptiveClip",
           "count_noise_std", "update_multiplier"]
