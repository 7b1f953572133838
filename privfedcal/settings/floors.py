"""Narrow, typed options: what each layer below the API needs of a run.

``RunConfig`` (config.py) is every setting of a run, as the user gives them. Below the
CLI and the API each layer takes only its part, as a frozen dataclass built once from the
resolved ``RunConfig`` (``run_options``) and passed down:

- ``DataOptions``: the dataset and how it is split among the clients (data/, federation/setup.py);
- ``LocalSpec``: how a client trains: the local method, its hyperparameters and the
  optimiser (federation/local.py, workers.py, vectorised.py);
- ``EngineOptions``: where and how the run computes: device, processes, threads, batching;
- ``PrivacyOptions``: the protections and the public protocol they are planned over (the
  privacy planner, privfedcal/privacy/planner.py, and privacy/);
- ``LoopOptions``: what the round loop runs and records (federation/simulator.py).

Each field keeps its ``RunConfig`` name and meaning (its help text is there), so a setting
reads the same at every floor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from privfedcal.errors import UsageError

if TYPE_CHECKING:
    from privfedcal.settings.run_config import RunConfig


#: the optimisers local training implements (federation/local.py ``PlainSGD``,
#: vectorised.py ``StackedSGD``: SGD with momentum and weight decay)
OPTIMIZERS = ("sgd",)


def _pick(cls: type, cfg: RunConfig, **extra: Any) -> Any:
    """``cls`` with each field read from ``cfg`` by name, ``extra`` over them."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in extra]
    return cls(**{n: getattr(cfg, n) for n in names}, **extra)


@dataclass(frozen=True)
class DataOptions:
    """The dataset and its split among the clients. ``data_seed`` draws the partition and
    is the clients' secret under a protection (federation/setup.py ``resolve_data_seed``)."""

    dataset: str
    data_root: str | None
    download: bool
    partition: str
    clients: int
    alpha: float
    imbalance_factor: float
    shards_per_client: int
    min_size: int
    seed: int
    data_seed: int | None

    @classmethod
    def of(cls, cfg: RunConfig) -> DataOptions:
        return _pick(cls, cfg)


@dataclass(frozen=True)
class LocalSpec:
    """How one client trains: the local method with its hyperparameters, and SGD with
    momentum and weight decay (``optimizer``: the only one the trainers implement, named so a
    spec says what it trains with).
    Picklable: worker processes receive it once. ``dp_train``: local training is DP-SGD
    (the model gets GroupNorm); ``dp_sgd`` is then the planned ``DPSGDSpec``
    (privacy/dpsgd_local.py), set by the privacy planner."""

    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    augment: bool
    seed: int
    method: str = "fedavg"
    method_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: str = "sgd"
    dp_train: bool = False
    dp_sgd: Any = None
    mixed_precision: bool = False  # bf16 autocast on CUDA (local.choose_mixed_precision)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")

    @classmethod
    def of(cls, cfg: RunConfig) -> LocalSpec:
        """From a ``RunConfig`` whose per-model defaults are resolved
        (``config.resolve_training_defaults``)."""
        unresolved = [n for n in ("local_epochs", "batch_size", "lr", "momentum",
                                  "weight_decay", "augment") if getattr(cfg, n) is None]
        if unresolved:
            raise ValueError(f"resolve {', '.join(unresolved)} first "
                             "(config.resolve_training_defaults)")
        return _pick(cls, cfg, method=cfg.local_method, method_params=dict(cfg.method_params),
                     optimizer="sgd", dp_sgd=None, mixed_precision=False)


@dataclass(frozen=True)
class EngineOptions:
    """Where and how the run computes; none of it changes the numbers beyond float rounding
    (docs/usage.md, "Speed")."""

    device: str
    workers: int
    threads: int | None
    client_batch: int
    precision: str
    deterministic: bool

    @classmethod
    def of(cls, cfg: RunConfig) -> EngineOptions:
        return _pick(cls, cfg)


@dataclass(frozen=True)
class PrivacyOptions:
    """What the privacy planner needs of a run: its protections (``RunConfig``'s
    "Privacy" settings, same names and meanings) and the public protocol they are planned
    over (clients, rounds, participation, the public seed: what ``cohorts.select_clients``
    draws the rounds' clients from), what runs (for messages and the DP-SGD check),
    DP-SGD's public schedule (the resolved local epochs and batch size) and the
    calibrator's parameters its release schedule depends on."""

    # the protections
    dp_eps: float
    dp_delta: float | None
    dp_clip: float | None
    dp_grad_clip: float | None
    accountant: str
    dp_train: bool
    dp_train_share: float
    dp_nominal_size: int | None
    dp_updates: bool
    dp_update_clip: float | None
    dp_updates_share: float
    dp_adaptive_clip: bool
    dp_clip_quantile: float
    secagg: bool
    hide_counts: bool
    insecure_seeded_noise: bool
    secagg_updates: bool
    secagg_min_clients: int
    secagg_key_holder: int | None
    stages: str  # opt-in stages by registered name, comma-separated
    # the public protocol
    clients: int
    rounds: int
    participation: float
    seed: int
    # what runs, and DP-SGD's public schedule
    method: str
    local_method: str
    calibrator: str
    local_epochs: int | None
    batch_size: int | None
    #: the calibrator's parameters (``--calibration-params``): its release schedule and its
    #: advice under DP read them (``Calibrator.release_rounds``, ``privacy_hints``)
    calibration_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dp_enabled(self) -> bool:
        return math.isfinite(self.dp_eps)

    @property
    def secure(self) -> bool:
        """Whether some uploads are summed under CKKS secure aggregation."""
        return self.secagg or self.secagg_updates

    @classmethod
    def of(cls, cfg: RunConfig) -> PrivacyOptions:
        return _pick(cls, cfg, local_method=cfg.local_method, calibrator=cfg.calibrator,
                     calibration_params=dict(cfg.calibration_params))


@dataclass(frozen=True)
class LoopOptions:
    """What the round loop runs and records: the rounds and how often it evaluates, the
    public seed of its per-round draws, whether it records the server's view, and the names
    of what runs (for summary.json and its messages)."""

    method: str
    local_method: str
    calibrator: str
    dataset: str
    clients: int
    rounds: int
    eval_every: int
    seed: int
    transcript: bool

    @classmethod
    def of(cls, cfg: RunConfig) -> LoopOptions:
        return _pick(cls, cfg, local_method=cfg.local_method, calibrator=cfg.calibrator)


class RunOptions(NamedTuple):
    """The narrow options of one run, built together from its ``RunConfig``."""

    data: DataOptions
    training: LocalSpec
    engine: EngineOptions
    privacy: PrivacyOptions
    loop: LoopOptions


def run_options(cfg: RunConfig) -> RunOptions:
    """Every narrow option of ``cfg`` (resolved: ``config.resolve_training_defaults``)."""
    return RunOptions(DataOptions.of(cfg), LocalSpec.of(cfg), EngineOptions.of(cfg),
                      PrivacyOptions.of(cfg), LoopOptions.of(cfg))
