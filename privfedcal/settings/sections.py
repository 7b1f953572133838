"""The sections of a run's settings, each declared once with its defaults, help and rules.

A section is a frozen dataclass whose fields are made by ``setting(...)``
(privfedcal/settings/descriptions.py): the help text, help group, flag spelling and default
live on the field, and the section's ``__post_init__`` holds the rules that concern its
settings alone. ``RunConfig`` (privfedcal/settings/run_config.py) holds one of each, beside
what names the run as a whole (method, model, calibrator and their parameters), and checks
the few rules that span two sections. Field names are the CLI flags with ``-`` as ``_`` and
the keys of the flat ``config.json``; a section's fields follow one another in that file.

- ``DataSettings``: the dataset and how it is split among the clients;
- ``TrainingSettings``: the rounds, local training's optimiser and the seeds;
- ``EngineSettings``: where and how the run computes (no effect on the numbers beyond
  float rounding);
- ``PrivacySettings``: the protections of the uploads and of the model updates;
- ``OutputSettings``: the run folder and what it records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privfedcal.settings.descriptions import (
    PER_MODEL,
    refuse_bad_choices,
    refuse_failed,
    setting,
)
from privfedcal.settings.messages import SettingText
from privfedcal.settings.privacy_section import MAX_EPSILON, PrivacySettings

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class DataSettings:
    """The dataset and its split among the clients."""

    dataset: str = setting("digits", "digits | cifar10 | cifar100 | stl10 | imagefolder:PATH | "
                           "npz:PATH", group="Data")
    data_root: str | None = setting(None, "Folder holding the dataset files.", group="Data")
    download: bool = setting(False, "Download if missing (needs network).", group="Data")
    augment: bool | None = setting(None, "Random crop + flip.", group="Data",
                                   shown="the dataset's, see docs/usage.md")
    clients: int = setting(10, "Number of clients K.", group="Data")
    partition: str = setting("dirichlet", "iid | dirichlet | longtail | longtail-dirichlet | "
                             "shards | domains | natural", group="Data")
    alpha: float = setting(0.1, "Dirichlet concentration (smaller = more skew).", group="Data")
    imbalance_factor: float = setting(10.0, "Long-tail imbalance factor IF.", group="Data")
    shards_per_client: int = setting(2, "Shards per client (shards partition).", group="Data")
    min_size: int = setting(10, "Fewest samples any client may hold.", group="Data")

    def __post_init__(self) -> None:
        refuse_failed([
            (self.clients >= 1, "{clients} must be >= 1"),
            (self.alpha > 0, f"{{alpha}} must be > 0 (got {self.alpha})"),
            (self.imbalance_factor >= 1, "{imbalance_factor} must be >= 1"),
        ])


@dataclass(frozen=True)
class TrainingSettings:
    """The rounds, local training (its per-model defaults are None until resolved:
    ``run_config.resolve_training_defaults``) and the seeds."""

    rounds: int = setting(30, "Communication rounds.", group="Training")
    local_epochs: int | None = setting(None, "Local epochs E.", group="Training", shown=PER_MODEL)
    batch_size: int | None = setting(None, "Local batch size.", group="Training", shown=PER_MODEL)
    lr: float | None = setting(None, "Local SGD learning rate.", group="Training",
                               shown=PER_MODEL)
    momentum: float | None = setting(None, "Local SGD momentum.", group="Training",
                                     shown=PER_MODEL)
    weight_decay: float | None = setting(None, "Local SGD weight decay.", group="Training",
                                         shown=PER_MODEL)
    participation: float = setting(1.0, "Fraction of clients per round.", group="Training")
    eval_every: int = setting(1, "Evaluate every N rounds.", group="Training")
    seed: int = setting(0, "Random seed.", group="Training")
    data_seed: int | None = setting(
        None, "Seed of the data partition, never sent to the server (docs/threat-model.md).",
        group="Training", shown="--seed; OS entropy under a protection")

    def __post_init__(self) -> None:
        refuse_failed([
            (self.rounds >= 1, "{rounds} must be >= 1"),
            (self.local_epochs is None or self.local_epochs >= 1, "{local_epochs} must be >= 1"),
            (self.batch_size is None or self.batch_size >= 1, "{batch_size} must be >= 1"),
            (self.lr is None or (self.lr > 0 and math.isfinite(self.lr)),
             "{lr} must be a finite number > 0"),
            (self.momentum is None or 0 <= self.momentum < 1, "{momentum} must be in [0, 1)"),
            (self.weight_decay is None or self.weight_decay >= 0, "{weight_decay} must be >= 0"),
            (0 < self.participation <= 1, "{participation} must be in (0, 1]"),
            (self.eval_every >= 1, "{eval_every} must be >= 1"),
            (self.data_seed is None or self.data_seed >= 0, "{data_seed} must be >= 0"),
        ])


@dataclass(frozen=True)
class EngineSettings:
    """Where and how the run computes; none of it changes the numbers beyond float rounding
    (docs/usage.md, "Speed")."""

    device: str = setting("auto", "auto | cpu | cuda", group="Hardware", choices=DEVICES)
    workers: int = setting(1, "Worker processes for local training and calibration payloads.",
                           group="Hardware")
    threads: int | None = setting(None, "Torch threads per process.", group="Hardware")
    client_batch: int = setting(1, "Clients trained at once as one batched computation "
                                "(1: one after the other); same results.", group="Hardware")
    precision: str = setting("auto", "auto | fp32 | bf16: bf16 autocast on CUDA (auto: for "
                             "models of 5M+ parameters).", group="Hardware", choices=PRECISIONS)
    deterministic: bool = setting(False, "Deterministic kernels: reproducible GPU runs "
                                  "(slower).", group="Hardware")

    def __post_init__(self) -> None:
        refuse_failed([
            (self.workers >= 1, "{workers} must be >= 1"),
            (self.threads is None or self.threads >= 1, "{threads} must be >= 1"),
            (self.client_batch >= 1, "{client_batch} must be >= 1"),
            (self.client_batch == 1 or self.workers == 1,
             SettingText("{client_batch} > 1 trains in this process: give {workers=} (or "
                         "{client_batch=})", workers=1, client_batch=1)),
        ])
        refuse_bad_choices(self, EngineSettings)


@dataclass(frozen=True)
class OutputSettings:
    """Where the run is written and what it records."""

    out: str | None = setting(None, "Run folder (default runs/<method>-<dataset>-<time>).",
                              group="Output", shown="")
    transcript: bool = setting(True, "Record the server's view.", group="Output")

#: the sections of ``RunConfig``, by attribute name, in ``config.json``'s order
SECTIONS: dict[str, type] = {"data": DataSettings, "training": TrainingSettings,
                             "engine": EngineSettings, "privacy": PrivacySettings,
                             "output": OutputSettings}

__all__ = ["DEVICES", "MAX_EPSILON", "PRECISIONS", "SECTIONS", "DataSettings",
           "EngineSettings", "OutputSettings", "PrivacySettings", "TrainingSettings"]
