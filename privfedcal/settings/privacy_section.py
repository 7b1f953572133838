"""The privacy section of a run's settings: every protection, declared once with its rules.

Its parts: the DP budget of the uploads (``dp_*``, ``accountant``), DP-SGD local training
(``dp_train*``, ``dp_nominal_size``), user-level DP of the model updates (``dp_updates``,
``dp_update_clip``, ``dp_updates_share``, ``dp_adaptive_clip``, ``dp_clip_quantile``),
secure aggregation (``secagg*``), hidden class counts (``hide_counts``) and the opt-in stages
(``stages``). The section refuses a combination of flags whose guarantee would not hold,
or a setting given without the protection it belongs to (a user would believe it in force);
the privacy planner (privfedcal/privacy/planner.py) keeps the checks that need the
calibrator's releases, the method or the federation's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privfedcal.settings.descriptions import setting
from privfedcal.settings.messages import SettingError, SettingText, refuse_failed

#: the largest --dp-eps accepted: beyond it the guarantee says nothing (e^100 ~ 2.7e43)
MAX_EPSILON = 100.0


@dataclass(frozen=True)
class PrivacySettings:
    """The protections of a run (docs/privacy.md)."""

    dp_eps: float = setting(math.inf, "Total epsilon for the uploads (inf = off).",
                            group="Privacy")
    dp_delta: float | None = setting(None, "DP delta (default below 1/N).", group="Privacy")
    dp_clip: float | None = setting(None, "Feature norm bound R.", group="Privacy")
    dp_grad_clip: float | None = setting(None, "Per-sample class-gradient norm bound.",
                                         group="Privacy")
    accountant: str = setting("rdp", "rdp | prv", group="Privacy")
    dp_train: bool = setting(False, "DP-SGD local training.", group="Privacy")
    dp_train_share: float = setting(0.5, "Budget share of DP-SGD.", group="Privacy")
    dp_nominal_size: int | None = setting(
        None, "Public client size DP-SGD plans with (steps, sample rate); default: training "
        "examples / clients.", group="Privacy")
    dp_updates: bool = setting(False, "User-level DP-FedAvg on the model updates: each "
                               "client's update clipped, Gaussian noise on their sum.",
                               group="Privacy")
    dp_update_clip: float | None = setting(None, "L2 bound S of a client's model update "
                                           "under --dp-updates.", group="Privacy",
                                           shown="1.0")
    dp_updates_share: float = setting(0.5, "Budget share of --dp-updates beside calibration "
                                      "uploads.", group="Privacy")
    dp_adaptive_clip: bool = setting(False, "Move --dp-update-clip each round towards a "
                                     "quantile of the update norms (noised count).",
                                     group="Privacy")
    dp_clip_quantile: float = setting(0.5, "Target quantile of --dp-adaptive-clip.",
                                      group="Privacy")
    secagg: bool = setting(False, "CKKS secure aggregation.", group="Privacy")
    hide_counts: bool = setting(False, "Hide class counts.", group="Privacy",
                                flag="--hide-counts/--show-counts")
    insecure_seeded_noise: bool = setting(
        False, "INSECURE: draw DP noise from the seed (tests only).", group="Privacy",
        flag="--insecure-seeded-noise")
    secagg_updates: bool = setting(False, "CKKS sums of model updates.", group="Privacy")
    secagg_min_clients: int = setting(
        2, "Fewest uploads a secure aggregate may sum (>= 2); the key holder refuses fewer.",
        group="Privacy")
    secagg_key_holder: int | None = setting(
        None, "Client that also holds the CKKS secret key and sees every sum (Flower sets it "
        "from flower.key-holder): it needs --secagg-min-clients others in every sum.",
        group="Privacy")
    stages: str = setting("", "Extra protection stages a run switches on by their registered "
                          "names, comma-separated (CONTRIBUTING.md, privacy/stage_registry.py).",
                          group="Privacy")

    def __post_init__(self) -> None:
        refuse_failed(self._ranges())
        self._refuse_orphans()
        self._refuse_conflicts()

    # ---- predicates ---------------------------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        """Whether a DP budget is given (``--dp-eps``)."""
        return math.isfinite(self.dp_eps)

    @property
    def secure(self) -> bool:
        """Whether some uploads are summed under CKKS secure aggregation."""
        return self.secagg or self.secagg_updates

    @property
    def protected(self) -> bool:
        """Whether a built-in protection guards the uplink: any DP, secure aggregation or
        hidden counts (user-level DP needs the budget, so ``dp_enabled`` covers it)."""
        return bool(self.dp_enabled or self.dp_train or self.secure or self.hide_counts)

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The opt-in stages the run names (``--stages``)."""
        return tuple(s.strip() for s in self.stages.split(",") if s.strip())

    # ---- rules --------------------------------------------------------------------------
    def _ranges(self) -> list[tuple[bool, str]]:
        return [
            (self.dp_eps == math.inf or 0 < self.dp_eps <= MAX_EPSILON,
             f"{{dp_eps}} must be in (0, {MAX_EPSILON:g}] (omit it for no DP): a larger "
             "epsilon protects nothing"),
            (self.secagg_min_clients >= 2,
             "{secagg_min_clients} must be >= 2: a secure aggregate of one is that upload"),
            (self.dp_delta is None or 0 < self.dp_delta < 1, "{dp_delta} must be in (0, 1)"),
            (self.dp_clip is None or self.dp_clip > 0, "{dp_clip} must be > 0"),
            (self.dp_grad_clip is None or self.dp_grad_clip > 0, "{dp_grad_clip} must be > 0"),
            (0 < self.dp_train_share < 1, "{dp_train_share} must be in (0, 1)"),
            (self.dp_update_clip is None or (math.isfinite(self.dp_update_clip)
                                             and self.dp_update_clip > 0),
             "{dp_update_clip} must be a finite number > 0"),
            (0 < self.dp_updates_share < 1, "{dp_updates_share} must be in (0, 1)"),
            (0 < self.dp_clip_quantile < 1, "{dp_clip_quantile} must be in (0, 1)"),
            (self.dp_nominal_size is None or self.dp_nominal_size >= 1,
             "{dp_nominal_size} must be >= 1"),
            (not self.hide_counts or self.secagg,
             "{hide_counts} needs {secagg}: only inside ciphertexts are counts hidden"),
        ]

    def _refuse_orphans(self) -> None:
        """Settings without the protection they belong to would be ignored, and a user
        would believe them in force: refuse them."""
        dp_only = [("dp_delta", self.dp_delta is not None),
                   ("accountant", self.accountant != "rdp")]
        if not self.secagg:  # the clip bounds also size CKKS parameters under --secagg
            dp_only += [("dp_clip", self.dp_clip is not None),
                        ("dp_grad_clip", self.dp_grad_clip is not None)]
        orphans = [
            (not self.dp_enabled, dp_only, "belong(s) to a DP budget: give {dp_eps}"),
            (not self.dp_train, [("dp_train_share", self.dp_train_share != 0.5),
                                 ("dp_nominal_size", self.dp_nominal_size is not None)],
             "belong(s) to DP-SGD: give {dp_train}"),
            (not self.dp_updates, [("dp_update_clip", self.dp_update_clip is not None),
                                   ("dp_updates_share", self.dp_updates_share != 0.5),
                                   ("dp_adaptive_clip", self.dp_adaptive_clip)],
             "belong(s) to user-level DP: give {dp_updates}"),
        ]
        for missing, names, what in orphans:
            given = [name for name, on in names if on]
            if missing and given:
                raise SettingError("{given} " + what, given=SettingText.named(given))
        if not self.dp_adaptive_clip and self.dp_clip_quantile != 0.5:
            raise SettingError("{dp_clip_quantile} belongs to {dp_adaptive_clip}")
        if not self.secure and self.secagg_min_clients != 2:
            raise SettingError("{secagg_min_clients} belongs to secure aggregation: give "
                             "{secagg} or {secagg_updates}")
        if not self.secure and self.secagg_key_holder is not None:
            raise SettingError("{secagg_key_holder} belongs to secure aggregation: give "
                             "{secagg} or {secagg_updates}")

    def _refuse_conflicts(self) -> None:
        """Protections that cannot run together, or that need another one."""
        if self.dp_adaptive_clip and self.secagg_updates:
            raise SettingError("{dp_adaptive_clip} runs with central noise only: under "
                             "{secagg_updates} its count would leave the ciphertexts")
        if self.dp_train and not self.dp_enabled:
            raise SettingError("{dp_train} needs a budget: give {dp_eps}")
        if self.dp_updates and not self.dp_enabled:
            raise SettingError("{dp_updates} needs a budget: give {dp_eps}")
        if self.dp_updates and self.dp_train:
            raise SettingError("{dp_updates} and {dp_train} both protect the model updates and "
                             "are accounted apart: choose one ({dp_updates}: user level, which "
                             "covers every example of a client; {dp_train}: sample level)")
