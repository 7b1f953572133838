"""What each floor below the API receives of a run: its section of the settings, with
the few public facts of other sections it also needs.

``RunConfig`` (privfedcal/settings/run_config.py) is every setting of a run, in sections
(privfedcal/settings/sections.py). Below the CLI and the API each floor takes only its part,
built once from the resolved ``RunConfig`` (``run_options``) and passed down:

- ``DataOptions``: the data section and the seeds that draw the partition (data/,
  federation/setup.py);
- ``LocalSpec``: how a client trains: the training section itself (read as
  ``spec.training.lr``; ``spec.recipe`` holds its resolved recipe, typed as set), the data
  section (``spec.data.augment``) and the privacy section (``spec.privacy.dp_train``), the
  local method, its hyperparameters and the optimiser, the planned DP-SGD and precision
  (federation/local.py, workers.py, vectorised.py);
- ``EngineSettings``: the engine section itself: device, processes, threads, batching;
- ``PrivacyOptions``: the privacy section and the public protocol it is planned over (the
  privacy planner, privfedcal/privacy/planner.py, and privacy/);
- ``LoopOptions``: what the round loop runs and records: the names of what runs and the
  data, training and output sections themselves (federation/simulator.py).

``DataOptions`` and ``PrivacyOptions`` extend their section (its settings, defaults and
rules are declared there, once); ``LocalSpec`` and ``LoopOptions`` hold the sections they read
whole, never a copy of one of their settings; every field keeps its setting's name and
meaning, so a setting reads the same at every floor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from privfedcal.errors import UsageError
from privfedcal.settings.sections import (
    DataSettings,
    EngineSettings,
    OutputSettings,
    PrivacySettings,
    TrainingSettings,
)

if TYPE_CHECKING:
    from privfedcal.settings.run_config import RunConfig


#: the optimisers local training implements (federation/local.py ``PlainSGD``,
#: vectorised.py ``StackedSGD``: SGD with momentum and weight decay)
OPTIMIZERS = ("sgd",)


def values(section: Any) -> dict[str, Any]:
    """A section's settings by name (shallow: tables stay the section's own)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


@dataclass(frozen=True, kw_only=True)
class DataOptions(DataSettings):
    """The data section, with the seeds of the partition: ``data_seed`` draws it and is the
    clients' secret under a protection (federation/setup.py ``resolve_data_seed``); ``seed``
    draws it when none is given and the partition is public."""

    seed: int = 0
    data_seed: int | None = None

    @classmethod
    def of(cls, cfg: RunConfig) -> DataOptions:
        return cls(**values(cfg.data), seed=cfg.training.seed,
                   data_seed=cfg.training.data_seed)


#: the training section's settings a client trains with, resolved per model before training
RECIPE = ("local_epochs", "batch_size", "lr", "momentum", "weight_decay")


class Recipe(NamedTuple):
    """The resolved ``RECIPE`` of a ``LocalSpec``, typed as set (never None)."""

    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float


@dataclass(frozen=True)
class LocalSpec:
    """How one client trains: the sections it reads, held whole (the training section:
    epochs, batch size, SGD's learning rate, momentum and weight decay, resolved per model,
    and the public seed of the clients' draws; the data section: whether batches are
    augmented, ``data.augment``; the privacy section: whether local training is DP-SGD,
    ``privacy.dp_train``, which gives the model GroupNorm), the local method with its
    hyperparameters, and ``optimizer``: the only one the trainers implement, SGD with
    momentum and weight decay, named so a spec says what it trains with.
    The recipe and ``data.augment`` are resolved first (``__post_init__`` refuses None).
    Picklable: worker processes receive it once. ``dp_sgd`` is the planned ``DPSGDSpec``
    (privacy/dpsgd_local.py) under DP-SGD, set by the privacy planner."""

    training: TrainingSettings
    data: DataSettings
    privacy: PrivacySettings = dataclasses.field(default_factory=PrivacySettings)
    method: str = "fedavg"
    method_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: str = "sgd"
    dp_sgd: Any = None
    mixed_precision: bool = False  # bf16 autocast on CUDA (local.choose_mixed_precision)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")
        unresolved = [n for n in RECIPE if getattr(self.training, n) is None]
        unresolved += ["augment"] if self.data.augment is None else []
        if unresolved:
            raise ValueError(f"resolve {', '.join(unresolved)} first "
                             "(run_config.resolve_training_defaults)")

    @property
    def recipe(self) -> Recipe:
        """The training recipe, resolved (``__post_init__`` refuses a spec without it)."""
        return Recipe(*(getattr(self.training, n) for n in RECIPE))

    @classmethod
    def of(cls, cfg: RunConfig) -> LocalSpec:
        """From a ``RunConfig`` whose per-model defaults are resolved
        (``run_config.resolve_training_defaults``)."""
        return cls(training=cfg.training, data=cfg.data, privacy=cfg.privacy,
                   method=cfg.local_method, method_params=dict(cfg.method_params))


@dataclass(frozen=True, kw_only=True)
class PrivacyOptions(PrivacySettings):
    """What the privacy planner needs of a run: the privacy section (its protections,
    declared and checked there) and the public protocol they are planned over (clients,
    rounds, participation, the public seed: what ``cohorts.select_clients`` draws the
    rounds' clients from), what runs (for messages and the DP-SGD check), DP-SGD's public
    schedule (the resolved local epochs and batch size) and the calibrator's parameters its
    release schedule depends on."""

    # the public protocol
    clients: int = 10
    rounds: int = 30
    participation: float = 1.0
    seed: int = 0
    # what runs, and DP-SGD's public schedule
    method: str = "fedavg"
    local_method: str = "fedavg"
    calibrator: str = "none"
    local_epochs: int | None = None
    batch_size: int | None = None
    #: the calibrator's parameters (``--calibration-params``): its release schedule and its
    #: advice under DP read them (``Calibrator.release_rounds``, ``privacy_hints``)
    calibration_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, cfg: RunConfig) -> PrivacyOptions:
        t = cfg.training
        return cls(**values(cfg.privacy), clients=cfg.data.clients, rounds=t.rounds,
                   participation=t.participation, seed=t.seed, method=cfg.method,
                   local_method=cfg.local_method, calibrator=cfg.calibrator,
                   local_epochs=t.local_epochs, batch_size=t.batch_size,
                   calibration_params=dict(cfg.calibration_params))


@dataclass(frozen=True)
class LoopOptions:
    """What the round loop runs and records: the names of what runs (for summary.json and
    its messages) and the sections it reads: the data section (the dataset, the number of
    clients), the training section (the rounds, how often it evaluates, the public seed of
    its per-round draws) and the output section (whether it records the server's view)."""

    method: str
    local_method: str
    calibrator: str
    data: DataSettings
    training: TrainingSettings
    output: OutputSettings

    @classmethod
    def of(cls, cfg: RunConfig) -> LoopOptions:
        return cls(method=cfg.method, local_method=cfg.local_method, calibrator=cfg.calibrator,
                   data=cfg.data, training=cfg.training, output=cfg.output)


class RunOptions(NamedTuple):
    """The narrow options of one run, built together from its ``RunConfig``."""

    data: DataOptions
    training: LocalSpec
    engine: EngineSettings
    privacy: PrivacyOptions
    loop: LoopOptions


def run_options(cfg: RunConfig) -> RunOptions:
    """Every narrow option of ``cfg`` (resolved: ``run_config.resolve_training_defaults``)."""
    return RunOptions(DataOptions.of(cfg), LocalSpec.of(cfg), cfg.engine,
                      PrivacyOptions.of(cfg), LoopOptions.of(cfg))
