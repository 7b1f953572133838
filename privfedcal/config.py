"""Every setting of a run, in one frozen dataclass: the one place that holds the defaults.

CLI flags and ``--config FILE`` (TOML, or a run's own ``config.json``) map onto ``RunConfig``
(flags override the file); ``config.json`` in the run folder is the *resolved*
``RunConfig.to_dict()`` plus versions. Settings left ``None`` (model, optimiser, local epochs,
augmentation) are resolved per model and dataset by :func:`resolve_training_defaults` from
``TRAINING_DEFAULTS`` (docs/usage.md, "Defaults per model").
"""

from __future__ import annotations

import dataclasses
import json
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

#: Local-training defaults per model family (docs/usage.md, "Defaults per model"). "paper":
#: the CNN / ResNet / MobileNet settings of CCVR and MOON on CIFAR-like data (SGD lr 0.01,
#: momentum 0.9, weight decay 1e-5, batch 64, E = 10 local epochs); "small": the digits MLP's.
TRAINING_DEFAULTS: dict[str, dict[str, Any]] = {
    "small": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": 32,
              "local_epochs": 2},
    "paper": {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": 64,
              "local_epochs": 10},
}
#: model -> family of TRAINING_DEFAULTS; every model not listed is "paper"
MODEL_FAMILY: dict[str, str] = {"mlp": "small", "digits-cnn": "small"}
#: smallest input side each model is built for (its stride-2 stages shrink 8x8 digits to
#: 1x1 maps); smaller inputs train near chance, so the run warns at start
MODEL_MIN_INPUT: dict[str, int] = {"cnn": 16, "resnet8": 16, "resnet18": 16, "mobilenetv2": 16}
#: keys of a run's config.json that record the run rather than set it
RUN_RECORD_KEYS = ("versions", "flower_run_id")


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
    min_size: int = 10
    # training
    rounds: int = 30
    local_epochs: int | None = None  # None: per model (TRAINING_DEFAULTS)
    batch_size: int | None = None
    lr: float | None = None
    momentum: float | None = None
    weight_decay: float | None = None
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
            (self.local_epochs is None or self.local_epochs >= 1, "--local-epochs must be >= 1"),
            (self.batch_size is None or self.batch_size >= 1, "--batch-size must be >= 1"),
            (self.lr is None or (self.lr > 0 and math.isfinite(self.lr)),
             "--lr must be a finite number > 0"),
            (self.momentum is None or 0 <= self.momentum < 1, "--momentum must be in [0, 1)"),
            (self.weight_decay is None or self.weight_decay >= 0, "--weight-decay must be >= 0"),
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
        if self.method in METHOD_ALIASES and self.calibrate not in ("none", self.calibrator_of_alias):
            raise UsageError(
                f"--method {self.method} already calibrates with {self.calibrator_of_alias}; "
                f"--calibrate {self.calibrate} would be ambiguous: use --method "
                f"{METHOD_ALIASES[self.method][0]} --calibrate {self.calibrate}")

    @property
    def calibrator_of_alias(self) -> str:
        return METHOD_ALIASES[self.method][1] if self.method in METHOD_ALIASES else "none"

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
    def from_dict(cls, d: dict[str, Any], *, where: str = "") -> RunConfig:
        """Build from plain values (a TOML/JSON file, flags); unknown names and wrong types
        raise a one-line UsageError (``where`` prefixes it, e.g. the file name)."""
        prefix = f"{where}: " if where else ""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UsageError(f"{prefix}unknown setting(s) {', '.join(unknown)}; valid names: "
                             f"{', '.join(sorted(names))}")
        d = dict(d)
        if d.get("dp_eps", 0) is None:
            d["dp_eps"] = math.inf
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        for key, value in d.items():
            d[key] = _check_type(key, types[key], value, prefix)
        return cls(**d)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


_KINDS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,),
                                       "bool": (bool,)}
_KIND_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _check_type(key: str, annotation: str, value: Any, prefix: str = "") -> Any:
    """``value`` if it fits the field's annotation (ints widen to float), else UsageError.
    Annotations this does not know (added fields with richer types) are not checked."""
    optional = annotation.endswith(" | None")
    kind = annotation.removesuffix(" | None")
    if value is None and optional:
        return None
    if kind.startswith("dict"):
        if not isinstance(value, dict):
            raise UsageError(f"{prefix}{key} must be a table of name = value, got {value!r}")
        return {k.replace("-", "_"): v for k, v in value.items()}
    if kind not in _KINDS:
        return value
    ok = isinstance(value, _KINDS[kind]) and (kind == "bool" or not isinstance(value, bool))
    if not ok:
        raise UsageError(f"{prefix}{key} must be {_KIND_NAMES[kind]}, got {value!r}")
    return float(value) if kind == "float" else value


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a ``--config`` file: top-level keys are RunConfig fields (``-`` or ``_``);
    tables ``[method_params]`` and ``[calibration_params]`` hold hyperparameters.

    A ``.json`` file is read as a run's ``config.json``: its ``versions`` (and a Flower
    run's id) and ``out`` are ignored (a re-run writes a new folder). Unknown top-level names and wrong types raise a
    one-line UsageError; the tables' names are checked against the method and calibrator
    when the run is built (they depend on which ones run)."""
    p = Path(path)
    is_json = p.suffix.lower() == ".json"
    try:
        text = p.read_text()
        raw = json.loads(text) if is_json else tomllib.loads(text)
    except FileNotFoundError:
        raise UsageError(f"config file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config file {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {p} is not valid TOML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"config file {p} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"config file {p} must hold a table of settings")
    if is_json:
        for key in RUN_RECORD_KEYS + ("out",):
            raw.pop(key, None)
    out = {k.replace("-", "_"): v for k, v in raw.items()}
    names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(out) - names)
    if unknown:
        raise UsageError(f"config file {p}: unknown setting(s) {', '.join(unknown)}; valid "
                         f"names: {', '.join(sorted(names))}")
    if "dp_eps" in out and out["dp_eps"] is None:  # config.json writes "off" (inf) as null
        out["dp_eps"] = math.inf
    types = {f.name: str(f.type) for f in dataclasses.fields(RunConfig)}
    return {k: _check_type(k, types[k], v, f"config file {p}: ") for k, v in out.items()}


def resolve_training_defaults(cfg: RunConfig, *, model: str, augment: bool) -> RunConfig:
    """``cfg`` with every setting left None filled in: ``model`` (the dataset's default
    model), ``augment`` (the dataset's), and the optimiser from ``TRAINING_DEFAULTS`` for
    the model's family. Values the user gave are kept."""
    table = TRAINING_DEFAULTS[MODEL_FAMILY.get(cfg.model or model, "paper")]
    changes: dict[str, Any] = {k: v for k, v in table.items() if getattr(cfg, k) is None}
    if cfg.model is None:
        changes["model"] = model
    if cfg.augment is None:
        changes["augment"] = augment
    return cfg.replace(**changes) if changes else cfg


def resolved_line(cfg: RunConfig) -> str:
    """One line naming the resolved model and local-training settings."""
    return (f"model {cfg.model}, lr {cfg.lr:g}, momentum {cfg.momentum:g}, weight decay "
            f"{cfg.weight_decay:g}, batch {cfg.batch_size}, local epochs {cfg.local_epochs}, "
            f"augment {'on' if cfg.augment else 'off'}")
