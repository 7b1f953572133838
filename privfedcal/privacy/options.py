"""The settings the protection planner reads, as one frozen, typed value.

``PrivacyOptions`` is read from the run's ``RunConfig`` once, at the top (privfedcal/
protection.py ``privacy_options``), together with the public facts the plan depends on: the
federation's shape (clients, rounds, participation, seed: who is asked when), the public
local schedule DP-SGD is planned with, the number of training examples N, and the releases
the run's calibrator declares with the rounds it makes them in. Below that point nothing
reads the ``RunConfig``: the planner (``plan_protection``) is a function of this value
alone. Field names are the ``RunConfig`` fields they come from, so functions of the public
schedule (``cohorts.select_clients``) take either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privfedcal.privacy.releases import ReleaseSpec


@dataclass(frozen=True)
class ReleaseSchedule:
    """One release a calibrator declares and the rounds it makes it in (per-round releases;
    a release made once, after training, lists none)."""

    spec: ReleaseSpec
    rounds: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrivacyOptions:
    """What a run asks of its protection (docs/privacy.md): DP, secure aggregation, hidden
    counts, extra stages by name, and the public facts the plan is computed from."""

    # the federation (public: who is asked when)
    clients: int
    rounds: int
    participation: float = 1.0
    seed: int = 0
    examples: int | None = None  # N: training examples in the federation (public)
    # the calibrator and what it releases
    calibrator: str = "none"
    protectable: bool = True
    releases: tuple[ReleaseSchedule, ...] = ()
    hints: tuple[str, ...] = ()
    # the local method and its public schedule (DP-SGD is planned on it)
    method: str = "fedavg"
    local_method: str = "fedavg"
    batch_size: int = 32
    local_epochs: int = 1
    # sample-level DP
    dp_eps: float = math.inf
    dp_delta: float | None = None
    dp_clip: float | None = None
    dp_grad_clip: float | None = None
    accountant: str = "rdp"
    dp_train: bool = False
    dp_train_share: float = 0.5
    dp_nominal_size: int | None = None
    # user-level DP of the model updates
    dp_updates: bool = False
    dp_update_clip: float | None = None
    dp_updates_share: float = 0.5
    dp_adaptive_clip: bool = False
    dp_clip_quantile: float = 0.5
    # secure aggregation
    secagg: bool = False
    hide_counts: bool = False
    secagg_updates: bool = False
    secagg_min_clients: int = 2
    secagg_key_holder: int | None = None
    insecure_seeded_noise: bool = False
    #: opt-in stages the run switches on by name (privacy/stage_registry.py)
    stages: tuple[str, ...] = ()

    @property
    def dp_enabled(self) -> bool:
        return math.isfinite(self.dp_eps)

    @property
    def protected(self) -> bool:
        """Whether anything guards the uplink (otherwise: in the clear, no bound)."""
        return bool(self.dp_enabled or self.secagg or self.hide_counts or self.dp_train
                    or self.secagg_updates or self.stages)

    def schedule(self, label: str) -> ReleaseSchedule:
        return next(r for r in self.releases if r.spec.label == label)
