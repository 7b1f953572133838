"""The executor of a protection plan: the live uplink, built from the frozen plan.

``execute_plan`` turns a ``ProtectionPlan`` (privacy/plan.py, from the planner
``privfedcal.privacy.planner.plan_protection``) into the objects a run uses: one ``DPAccounting``
with fresh accountants and ledgers (shared by the noise stage, the encrypt stage's bounds
and DP-FedAvg), every planned stage through its registry entry (privacy/stage_registry.py),
DP-FedAvg and the model updates' CKKS wire where planned, and the ``Uplink`` around them.
``training_spec`` gives the local training its DP-SGD schedule. The simulator, the Flower
apps and the Flower plugin all run what this builds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from privfedcal.privacy.noise import warn_if_seeded
from privfedcal.privacy.plan import CKKSPlan, ProtectionPlan, UserDPPlan
from privfedcal.privacy.stage_registry import STAGES, Shared
from privfedcal.privacy.uplink import Uplink

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting


def execute_plan(plan: ProtectionPlan) -> Uplink:
    """The live uplink of ``plan``: its stages built by their registry entries around one
    ``DPAccounting`` (fresh accountants), DP-FedAvg and the model updates' wire where planned."""
    if not plan.protected:
        return Uplink()
    warn_if_seeded(plan.inputs.privacy.insecure_seeded_noise)
    shared = Shared(dp=plan.noise.live() if plan.noise is not None else None)
    stages = [STAGES[name].build(setup, shared) for name, setup in plan.stages]
    privacy = plan.inputs.privacy
    up = Uplink(stages=stages, hide_counts=privacy.hide_counts, hints=list(plan.hints),
                seeded_noise=privacy.insecure_seeded_noise)
    if plan.user_dp is not None:
        up.user_dp = live_user_dp(plan.user_dp, shared.dp)
    if plan.updates is not None:
        up.updates = updates_uplink(plan.updates)
    return up


def live_user_dp(p: UserDPPlan, dp: DPAccounting | None) -> Any:
    """DP-FedAvg (privacy/user_dp.py ``UserDP``) of plan ``p``, charged to ``dp``."""
    from privfedcal.privacy.adaptive_clip import AdaptiveClip
    from privfedcal.privacy.user_dp import UserDP

    return UserDP(dp, p.clip, denominator=p.denominator, distributed=p.distributed,
                  seed=p.seed, seeded=p.seeded,
                  adaptive=None if p.adaptive_quantile is None
                  else AdaptiveClip(p.adaptive_quantile))


def updates_uplink(p: CKKSPlan) -> Uplink:
    """The model updates' own uplink under --secagg-updates: the encrypt wire alone."""
    from privfedcal.privacy.secagg_stage import CKKSSettings, EncryptStage

    return Uplink(stages=[EncryptStage(CKKSSettings.from_plan(p, dp=None))])


def training_spec(spec: Any, plan: ProtectionPlan) -> Any:
    """The local-training spec ``spec`` with the plan's DP-SGD schedule (unchanged without
    --dp-train): what the simulator's and a Flower node's trainers run."""
    if plan.dp_sgd is None:
        return spec
    return dataclasses.replace(spec, dp_sgd=plan.dp_sgd)
