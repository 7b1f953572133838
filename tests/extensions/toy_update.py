"""A toy protection of the model updates in one file: each client scales its update, the
server undoes it on the average.

It shows everything an update stage needs and nothing else: an ``UpdateStage``
(privfedcal/privacy/update_stage.py) with a client half (run on each client's trained state
before it leaves) and a server half (run on the round's average), its own set-up read from
the run's ``ProtectionPlan`` (the run's rounds, which it reports), its own state saved for
resume (the rounds it has seen and the updates it scaled), its entry in the summary
(``summary.json``'s ``privacy.toy_update``), and one ``register_stage`` call with
``updates=True``.

Switch it on for a run: import this module (importing registers the stage
``toy-update-scale``), then name it in the run's ``stages`` setting (``SETTINGS`` below):
``privfedcal.train(..., stages="toy-update-scale")`` or ``--stages toy-update-scale`` in a
process that imported it. ``evidence(run_dir)`` reads a finished run's folder. Nothing
outside this file changes.

The factor is a power of two: scaling the floating entries of a state by it and the
average back is exact in floating point (the weighted average is linear), so a run with the
toy trains exactly the model of the run without it, while the server's record holds the
scaled states. It protects nothing (the factor is public): a toy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfedcal.privacy.plan import ProtectionPlan
from privfedcal.privacy.stage_registry import Shared, StageEntry, register_stage
from privfedcal.privacy.update_stage import State, UpdateRound, UpdateStage

NAME = "toy-update-scale"
FACTOR = 0.25
#: the run settings that switch the stage on (once this module is imported)
SETTINGS = {"stages": NAME}


@dataclass(frozen=True)
class ToyUpdateSetup:
    """The toy's part of the plan: the factor and the rounds the run plans."""

    factor: float
    rounds: int


@dataclass
class ToyUpdateStage(UpdateStage):
    """Multiplies the floating entries of each client's state by ``setup.factor`` on the
    client; divides the average by it on the server."""

    setup: ToyUpdateSetup
    scaled: int = 0  # client states scaled, over the run
    rounds: int = 0  # rounds whose average it restored
    restored: int = 0  # times its state came back from a checkpoint
    name = NAME

    def client(self, state: State, rnd: UpdateRound) -> State:
        self.scaled += 1
        return {k: v * self.setup.factor if v.is_floating_point() else v
                for k, v in state.items()}

    def server(self, average: State, rnd: UpdateRound) -> State:
        return {k: v / self.setup.factor if v.is_floating_point() else v
                for k, v in average.items()}

    def close(self, rnd: UpdateRound) -> None:
        self.rounds += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scaled": self.scaled, "rounds": self.rounds, "restored": self.restored}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaled = int(state.get("scaled", 0))
        self.rounds = int(state.get("rounds", 0))
        self.restored = int(state.get("restored", 0)) + 1

    def summary(self) -> dict[str, Any]:
        return {"toy_update": {"factor": self.setup.factor, "planned_rounds": self.setup.rounds,
                               "scaled": self.scaled, "rounds": self.rounds,
                               "restored": self.restored}}


def plan_toy(plan: ProtectionPlan) -> ToyUpdateSetup:
    """Pure: the toy's set-up from the plan."""
    return ToyUpdateSetup(FACTOR, plan.inputs.privacy.rounds)


def build_toy(setup: ToyUpdateSetup, shared: Shared) -> ToyUpdateStage:
    return ToyUpdateStage(setup)


ENTRY = register_stage(StageEntry(NAME, plan_toy, build_toy, updates=True, opt_in=True))


def evidence(run_dir: str | Path) -> dict[str, Any]:
    """From a run folder's ``summary.json``: ``ran``, the stage saw every round of the run
    and scaled updates; ``resumed``, its state came back from the checkpoint and it still
    counts every round, the ones before the resume included."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    toy = summary.get("privacy", {}).get("toy_update", {})
    every_round = toy.get("rounds") == summary.get("rounds")
    return {"ran": toy.get("scaled", 0) > 0 and every_round,
            "resumed": toy.get("restored", 0) >= 1 and every_round, "summary": toy}
