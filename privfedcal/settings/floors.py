"""What each floor below the API receives of a run: its section of the settings, with
the other sections it also reads, held whole.

``RunConfig`` (privfedcal/settings/run_config.py) is every setting of a run, in sections
(privfedcal/settings/sections.py). Below the CLI and the API each floor takes only its part,
built once from the resolved ``RunConfig`` (``run_options``) and passed down:

- ``DataOptions``: the data section, with the training section that holds the seeds that
  draw the partition (``data.seed``, ``data.data_seed``; data/, federation/setup.py);
- ``LocalSpec``: how a client trains: the training section itself (read as
  ``spec.training.lr``; ``spec.recipe`` holds its resolved recipe, typed as set), the data
  section (``spec.data.augment``) and the privacy section (``spec.privacy.dp_train``), the
  local method, its hyperparameters and the optimiser, the planned DP-SGD and precision
  (federation/local.py, workers.py, vectorised.py);
- ``EngineSettings``: the engine section itself: device, processes, threads, batching;
- ``PrivacyOptions``: the privacy section, with the data and training sections of the
  public protocol it is planned over (``p.clients``, ``p.rounds``: the privacy planner,
  privfedcal/privacy/planner.py, and privacy/);
- ``LoopOptions``: what the round loop runs and records: the names of what runs and the
  data, training and output sections themselves (federation/simulator.py).

``DataOptions`` and ``PrivacyOptions`` extend their section (its settings, defaults and
rules are declared there, once) and declare no setting of another: the other sections they
read are fields of their own, and the few facts a floor reads of them by name are read-only
properties of the same name (``p.rounds`` is ``p.training.rounds``). ``LocalSpec`` and
``LoopOptions`` hold the sections they read whole. No floor copies a setting, so a setting
reads the same at every floor.
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
    """The data section, with the training section that holds the seeds of the partition:
    ``data_seed`` draws it and is the clients' secret under a protection
    (federation/setup.py ``resolve_data_seed``); ``seed`` draws it when none is given and
    the partition is public. Both are read off ``training``, never copied."""

    training: TrainingSettings = dataclasses.field(default_factory=TrainingSettings)

    @property
    def seed(self) -> int:
        """The run's public seed (``training.seed``)."""
        return self.training.seed

    @property
    def data_seed(self) -> int | None:
        """The seed of the partition (``training.data_seed``; None until resolved)."""
        return self.training.data_seed

    @classmethod
    def of(cls, cfg: RunConfig) -> DataOptions:
        return cls(**values(cfg.data), training=cfg.training)


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
    declared and checked there), the sections of the public protocol they are planned over,
    held whole (``data``: the clients; ``training``: the rounds, participation, the public
    seed that ``cohorts.select_clients`` draws the rounds' clients from, and DP-SGD's public
    schedule, the resolved local epochs and batch size), what runs (for messages and the
    DP-SGD check) and the calibrator's parameters its release schedule depends on. The
    public protocol reads as properties of the same names (``p.rounds`` is
    ``p.training.rounds``), never copied."""

    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    training: TrainingSettings = dataclasses.field(default_factory=TrainingSettings)
    # what runs: the run's own names, not settings of a section
    method: str = "fedavg"
    local_method: str = "fedavg"
    calibrator: str = "none"
    #: the calibrator's parameters (``--calibration-params``): its release schedule and its
    #: advice under DP read them (``Calibrator.release_rounds``, ``privacy_hints``)
    calibration_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def clients(self) -> int:
        """The number of clients K (``data.clients``)."""
        return self.data.clients

    @property
    def rounds(self) -> int:
        """The communication rounds (``training.rounds``)."""
        return self.training.rounds

    @property
    def participation(self) -> float:
        """The fraction of clients drawn per round (``training.participation``)."""
        return self.training.participation

    @property
    def seed(self) -> int:
        """The public seed of the rounds' draws (``training.seed``)."""
        return self.training.seed

    @property
    def local_epochs(self) -> int | None:
        """DP-SGD's local epochs (``training.local_epochs``; None until resolved)."""
        return self.training.local_epochs

    @property
    def batch_size(self) -> int | None:
        """DP-SGD's batch size (``training.batch_size``; None until resolved)."""
        return self.training.batch_size

    @classmethod
    def of(cls, cfg: RunConfig) -> PrivacyOptions:
        return cls(**values(cfg.privacy), data=cfg.data, training=cfg.training,
                   method=cfg.method, local_method=cfg.local_method,
                   calibrator=cfg.calibrator, calibration_params=dict(cfg.calibration_params))


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
