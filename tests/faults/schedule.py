"""The seeded scheduler: from one integer, a run configuration (a protection combination,
4-12 clients, participation 0.3-1.0, ``secagg_min_clients`` 2-3) and one fault. The same
seed always gives the same schedule, so a violation is replayed from its seed alone
(``python -m tests.faults.soak --replay SEED``)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

CREFF = {"match_steps": 5, "retrain_steps": 5}

#: protection combinations: name -> RunConfig settings
PROTECTIONS: dict[str, dict[str, Any]] = {
    "creff-secagg": dict(method="creff", secagg=True, hide_counts=True,
                         calibration_params=CREFF),
    "creff-secagg-dp": dict(method="creff", secagg=True, hide_counts=True, dp_eps=8.0,
                            calibration_params=CREFF),
    "creff-secagg-sample": dict(method="creff", secagg=True, hide_counts=True,
                                calibration_params={**CREFF, "weighting": "sample"}),
    "ccvr-secagg": dict(method="ccvr", secagg=True, hide_counts=True),
    "ccvr-secagg-dp": dict(method="ccvr", secagg=True, hide_counts=True, dp_eps=8.0),
    "fedavg-secagg-updates": dict(method="fedavg", secagg_updates=True),
    "fedavg-dp-train": dict(method="fedavg", dp_train=True, dp_eps=8.0),
    "fedavg-dp-updates": dict(method="fedavg", dp_updates=True, dp_eps=8.0),
    "fedavg-dp-updates-secagg": dict(method="fedavg", dp_updates=True, dp_eps=8.0,
                                     secagg_updates=True),
}

#: where a process is stopped: the seam, and whether before or after its real call
#: ("release": the transcript's record of a released aggregate)
SEAMS = ("record", "release", "checkpoint", "client_side", "server_side")
FAULTS = ("none", "stop", "stop", "stop", "nan-upload", "nan-loss", "budget", "refuse",
          "extend", "lost")


@dataclass(frozen=True)
class Schedule:
    seed: int
    engine: str  # "simulator" or "flower"
    settings: dict[str, Any]
    fault: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return json.dumps({"seed": self.seed, "engine": self.engine,
                           "settings": self.settings, "fault": self.fault}, sort_keys=True)


def draw(seed: int) -> Schedule:
    """The schedule of ``seed``."""
    rng = random.Random(seed)
    name = rng.choice(sorted(PROTECTIONS))
    clients = rng.randint(4, 12)
    settings = {**PROTECTIONS[name], "clients": clients, "rounds": rng.randint(2, 4),
                "participation": rng.choice([0.3, 0.5, 0.7, 1.0]),
                "seed": rng.randrange(1000), "data_seed": rng.randrange(1000)}
    minimum = rng.choice([2, 3])
    if settings.get("secagg") or settings.get("secagg_updates"):
        settings["secagg_min_clients"] = minimum
    kind = rng.choice(FAULTS)
    engine = "flower" if kind == "lost" else "simulator"
    fault: dict[str, Any] = {"kind": kind}
    if kind == "stop":
        where = rng.choice(SEAMS)
        fault.update(seam=where, when=rng.choice(["before", "after"]),
                     nth=rng.randint(1, 3 if where == "release" else 12))
    elif kind in ("nan-upload", "nan-loss", "refuse"):
        fault.update(nth=rng.randint(1, 8))
    elif kind == "budget":
        settings["dp_eps"] = rng.choice([0.05, 0.5])
        if not (settings.get("dp_train") or settings.get("dp_updates")):
            settings.setdefault("method", "ccvr")
    elif kind == "extend":
        fault.update(more=rng.randint(1, 2))
    elif kind == "lost":
        fault.update(victim=rng.randrange(clients), nth=rng.randint(1, 3),
                     reply=rng.choice(["error", "drop"]))
    return Schedule(seed, engine, settings, fault)


def parse(text: str) -> Schedule:
    """A schedule from ``describe``'s JSON (a violation's printed line)."""
    d = json.loads(text)
    return Schedule(int(d["seed"]), d["engine"], d["settings"], d.get("fault") or {})
