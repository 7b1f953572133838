"""A toy protection stage in one file: each client scales its upload, the server undoes it.

It shows everything a stage needs and nothing else: a ``Stage`` with a client half and a
server half, its own set-up read from the run's ``ProtectionPlan`` (the labels of the
releases the plan declares: it scales those and passes any other through), its own state
saved for resume (the rounds it has seen and how many releases of each label it has
scaled), its entry in the summary (``summary.json``'s ``privacy.toy_scale``), and one
``register_stage`` call that names the stage and declares its place (after the DP noise,
so the noise is calibrated to the unscaled sensitivities; the wire always comes last).

Switch it on for a run: import this module (importing registers the stage ``toy-scale``),
then name the stage in the run's ``stages`` setting (``SETTINGS`` below):
``privfedcal.train(..., stages="toy-scale")``, ``RunConfig.of(stages="toy-scale")``,
``stages = "toy-scale"`` in a settings file, or ``--stages toy-scale`` on the command line
of a process that imported it. ``evidence(run_dir)`` reads a finished run's folder: whether
the stage ran in every round and, after ``privfedcal.resume``, whether its state came back
from the checkpoint. Nothing outside this file changes.

The factor is a power of two below 1: scaling by it and back is exact in floating point,
and under CKKS the scaled sums stay inside the magnitude bounds the encrypt stage sized
its parameters for. It protects nothing (the factor is public): a toy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privfedcal.privacy.bound import Payload
from privfedcal.privacy.plan import ProtectionPlan
from privfedcal.privacy.stage_registry import Shared, StageEntry, register_stage
from privfedcal.privacy.stages import Release, Stage

NAME = "toy-scale"
FACTOR = 0.5
#: the run settings that switch the stage on (once this module is imported)
SETTINGS = {"stages": NAME}


@dataclass(frozen=True)
class ToyScaleSetup:
    """The toy's part of the plan: the factor and the release labels it scales."""

    factor: float
    labels: frozenset[str]


@dataclass
class ToyScaleStage(Stage):
    """Multiplies every tensor of an upload by ``setup.factor`` on the client; divides the
    sum by it where the sum is in the clear (scaling is linear, so the sum of scaled uploads
    is the scaled sum)."""

    setup: ToyScaleSetup
    scaled: dict[str, int] = field(default_factory=dict)  # releases scaled, per label
    rounds: int = 0  # training rounds seen (``after_training`` runs once a round)
    restored: int = 0  # times its state came back from a checkpoint
    name = NAME

    def client(self, payload: Any, rel: Release) -> Any:
        if rel.label not in self.setup.labels:
            return payload
        return {k: v * self.setup.factor for k, v in payload.items()}

    def server(self, total: Payload, rel: Release) -> Payload:
        if rel.label not in self.setup.labels:
            return total
        return {k: v / self.setup.factor for k, v in total.items()}

    def close(self, rel: Release) -> None:
        if rel.label in self.setup.labels:
            self.scaled[rel.label] = self.scaled.get(rel.label, 0) + 1

    def after_training(self, clients: list[int] | None) -> None:
        self.rounds += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scaled": dict(self.scaled), "rounds": self.rounds, "restored": self.restored}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaled = {str(k): int(v) for k, v in state.get("scaled", {}).items()}
        self.rounds = int(state.get("rounds", 0))
        self.restored = int(state.get("restored", 0)) + 1

    def summary(self) -> dict[str, Any]:
        return {"toy_scale": {"factor": self.setup.factor, "scaled": dict(self.scaled),
                              "rounds": self.rounds, "restored": self.restored}}


def plan_toy(plan: ProtectionPlan) -> ToyScaleSetup:
    """Pure: the toy's set-up from the plan (the declared releases' labels)."""
    return ToyScaleSetup(FACTOR, frozenset(s.spec.label for s in plan.inputs.releases))


def build_toy(setup: ToyScaleSetup, shared: Shared) -> ToyScaleStage:
    return ToyScaleStage(setup)


ENTRY = register_stage(StageEntry(NAME, plan_toy, build_toy, after=("noise",), opt_in=True))


def evidence(run_dir: str | Path) -> dict[str, Any]:
    """From a run folder's ``summary.json``: ``ran``, the stage scaled a release and saw
    every round of the run; ``resumed``, its state came back from the checkpoint
    (``privfedcal.resume``) and it still counts every round, the ones before the resume
    included (a fresh stage would count only the rounds after it). A DP run cannot be
    extended (its noise was planned for its rounds): resume a run without DP, or an
    interrupted one."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    toy = summary.get("privacy", {}).get("toy_scale", {})
    every_round = toy.get("rounds") == summary.get("rounds")
    return {"ran": bool(toy.get("scaled")) and every_round,
            "resumed": toy.get("restored", 0) >= 1 and every_round, "summary": toy}
