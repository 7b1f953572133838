"""Every setting of a run, in one frozen dataclass: the one place that holds the defaults.

CLI flags and ``--config FILE.toml`` map onto ``RunConfig`` (flags override the file);
``config.json`` in the run folder is ``RunConfig.to_dict()`` plus versions.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privfedcal.errors import UsageError

#: ``--method`` shorthands: (local method, calibrator)
METHOD_ALIASES: dict[str, tuple[str, str]] = {
    "ccvr": ("fedavg", "ccvr"),
    "creff": ("fedavg", "creff"),
}

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RunConfig:
    """A whole experiment. Field names are the CLI flags with ``-`` as ``_``."""

    # what to train
    method: str = "fedavg"
    model: str | None = None  # None: the dataset's default model
    method_params: dict[str, Any] = field(default_factory=dict)  # --mu, --tau, ... (None = default)
    # data
    dataset: str = "digits"
    data_root: str | None = None
    download: bool = False
    augment: bool | None = None  # None: on for natural-image sets, off for digits/npz
    clients: int = 10
    partition: str = "dirichlet"
    alpha: float = 0.1
    imbalance_factor: float = 10.0  # used by the longtail partition only
    shards_per_client: int = 2
    min_size: int = 2
    # training
    rounds: int = 30
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-5
    participation: float = 1.0
    eval_every: int = 1
    seed: int = 0
    device: str = "auto"
    workers: int = 1
    threads: int | None = None  # torch threads per process; None: cores // workers
    # calibration
    calibrate: str = "none"  # none | ccvr | creff | oracle | oracle:N
    calibration_params: dict[str, Any] = field(default_factory=dict)
    # privacy of the uploads
    dp_eps: float = math.inf
    dp_delta: float | None = None
    dp_clip: float | None = None
    dp_grad_clip: float | None = None
    accountant: str = "rdp"
    dp_train: bool = False
    dp_train_share: float = 0.5
    secagg: bool = False
    hide_counts: bool = False
    insecure_seeded_noise: bool = False  # DP noise from the public seed: tests/benchmarks only
    secagg_updates: bool = False  # model updates as CKKS sums (privacy/update_secagg.py)
    # outputs
    out: str | None = None
    transcript: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.clients >= 1, "--clients must be >= 1"),
            (self.alpha > 0, f"--alpha must be > 0 (got {self.alpha})"),
            (self.imbalance_factor >= 1, "--imbalance-factor must be >= 1"),
            (self.rounds >= 1, "--rounds must be >= 1"),
            (self.local_epochs >= 1, "--local-epochs must be >= 1"),
            (self.batch_size >= 1, "--batch-size must be >= 1"),
            (self.lr > 0, "--lr must be > 0"),
            (0 <= self.momentum < 1, "--momentum must be in [0, 1)"),
            (self.weight_decay >= 0, "--weight-decay must be >= 0"),
            (0 < self.participation <= 1, "--participation must be in (0, 1]"),
            (self.eval_every >= 1, "--eval-every must be >= 1"),
            (self.workers >= 1, "--workers must be >= 1"),
            (self.threads is None or self.threads >= 1, "--threads must be >= 1"),
            (self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}"),
            (self.dp_eps > 0, "--dp-eps must be > 0 (inf = off)"),
            (self.dp_delta is None or 0 < self.dp_delta < 1, "--dp-delta must be in (0, 1)"),
            (self.dp_clip is None or self.dp_clip > 0, "--dp-clip must be > 0"),
            (self.dp_grad_clip is None or self.dp_grad_clip > 0, "--dp-grad-clip must be > 0"),
            (0 < self.dp_train_share < 1, "--dp-train-share must be in (0, 1)"),
            (not self.hide_counts or self.secagg,
             "--hide-counts needs --secagg: only inside ciphertexts are counts hidden"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)

    # ---- derived --------------------------------------------------------------------
    @property
    def local_method(self) -> str:
        return METHOD_ALIASES.get(self.method, (self.method, ""))[0]

    @property
    def calibrator(self) -> str:
        if self.method in METHOD_ALIASES and self.calibrate == "none":
            return METHOD_ALIASES[self.method][1]
        return self.calibrate

    @property
    def dp_enabled(self) -> bool:
        return math.isfinite(self.dp_eps)

    # ---- (de)serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dp_eps"] = None if not math.isfinite(self.dp_eps) else self.dp_eps
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UsageError(f"unknown setting(s) {', '.join(unknown)}")
        d = dict(d)
        if d.get("dp_eps", 0) is None:
            d["dp_eps"] = math.inf
        return cls(**d)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a ``--config`` file: top-level keys are RunConfig fields (``-`` or ``_``);
    tables ``[method_params]`` and ``[calibration_params]`` hold hyperparameters."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"config file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config file {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {p} is not valid TOML: {exc}") from None
    out = {k.replace("-", "_"): v for k, v in raw.items()}
    names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(out) - names)
    if unknown:
        raise UsageError(f"config file {p}: unknown setting(s) {', '.join(unknown)}")
    return out
