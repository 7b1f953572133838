"""The executor of a protection plan: the live uplink, built from the frozen plan.

``execute_plan`` turns a ``ProtectionPlan`` (privacy/plan.py, from the planner
``privfedcal.privacy.planner.plan_protection``) into the objects a run uses: one ``DPAccounting``
with fresh accountants and ledgers (shared by the noise stage, the encrypt stage's bounds
and DP-FedAvg), every planned stage of the uploads and of the model updates through its
registry entry (privacy/stage_registry.py), and the ``Uplink`` around them.
``training_spec`` gives the local training its DP-SGD schedule. The simulator, the Flower
apps and the Flower plugin all run what this builds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from privfedcal.privacy.noise import warn_if_seeded
from privfedcal.privacy.plan import ProtectionPlan
from privfedcal.privacy.stage_registry import Shared, get_stage
from privfedcal.privacy.uplink import Uplink


def execute_plan(plan: ProtectionPlan) -> Uplink:
    """The live uplink of ``plan``: its stages, of the uploads and of the model updates,
    built by their registry entries around one ``DPAccounting`` (fresh accountants)."""
    if not plan.protected:
        return Uplink()
    warn_if_seeded(plan.inputs.privacy.insecure_seeded_noise)
    shared = Shared(dp=plan.noise.live() if plan.noise is not None else None)
    built = [(get_stage(name).updates, get_stage(name).build(setup, shared))
             for name, setup in plan.stages]
    privacy = plan.inputs.privacy
    return Uplink(stages=[s for updates, s in built if not updates],  # type: ignore[misc]
                  update_stages=[s for updates, s in built if updates],  # type: ignore[misc]
                  hide_counts=privacy.hide_counts, hints=list(plan.hints),
                  seeded_noise=privacy.insecure_seeded_noise)


def training_spec(spec: Any, plan: ProtectionPlan) -> Any:
    """The local-training spec ``spec`` with the plan's DP-SGD schedule (unchanged without
    --dp-train): what the simulator's and a Flower node's trainers run."""
    if plan.dp_sgd is None:
        return spec
    return dataclasses.replace(spec, dp_sgd=plan.dp_sgd)
