"""Every setting of a run, in one frozen dataclass: the one place that holds the defaults.

Each field is also the setting's description (help, group, flag; privfedcal/settings/descriptions.py),
from which the CLI options, settings-file checks, the Flower run config and the docs'
settings table are derived.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfedcal.errors import UsageError
from privfedcal.settings.descriptions import (
    PER_MODEL,
    calibration_settings,
    check_value,
    setting,
    settings_of,
)

#: the largest --dp-eps accepted: beyond it the guarantee says nothing (e^100 ~ 2.7e43)
MAX_EPSILON = 100.0

#: ``--method`` shorthands: (local method, calibrator)
METHOD_ALIASES: dict[str, tuple[str, str]] = {
    "ccvr": ("fedavg", "ccvr"),
    "creff": ("fedavg", "creff"),
}

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")

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
#: a run folder's record of its settings (federation/runfolder.py writes it)
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class RunConfig:
    """A whole experiment, and the description of every setting (privfedcal/settings/catalogue.py):
    each field carries its help text, help group and flag spelling. Field names are the CLI
    flags with ``-`` as ``_``."""

    # what to train
    method: str = setting("fedavg", "Local method or shorthand (ccvr, creff).", group="Method")
    model: str | None = setting(None, "Model (default: the dataset's).", group="Method",
                                shown="the dataset's, see docs/usage.md")
    method_params: dict[str, Any] = setting(
        None, "Method hyperparameters by name (None: the method's default).",
        group="Method hyperparameters", factory=dict, cli=False, shown="{}")
    # data
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
    # training
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
    # calibration
    calibrate: str = setting("none", "none | ccvr[:N] | creff[:N] | oracle[:N]; N: CCVR's "
                             "virtual features per class (--virtual-per-class), CReFF's "
                             "federated features per class (--features-per-class), the "
                             "oracle's real features per class (default all).",
                             group="Calibration")
    calibration_params: dict[str, Any] = setting(
        None, "Calibrator options by name (None: the calibrator's default).",
        group="Calibration", factory=dict, cli=False, shown="{}")
    # privacy of the uploads
    dp_eps: float = setting(math.inf, "Total epsilon for the uploads (inf = off).",
                            group="Privacy")
    dp_delta: float | None = setting(None, "DP delta (default below 1/N).", group="Privacy")
    dp_clip: float | None = setting(None, "Feature norm bound R.", group="Privacy")
    dp_grad_clip: float | None = setting(None, "Per-sample class-gradient norm bound.",
                                         group="Privacy")
    accountant: str = setting("rdp", "rdp | prv", group="Privacy")
    dp_train: bool = setting(False, "DP-SGD local training.", group="Privacy")
    dp_train_share: float = setting(0.5, "Budget share of DP-SGD.", group="Privacy")
    dp_nominal_size: int | None = setting(
        None, "Public client size DP-SGD plans with (steps, sample rate); default: training "
        "examples / clients.", group="Privacy")
    dp_updates: bool = setting(False, "User-level DP-FedAvg on the model updates: each "
                               "client's update clipped, Gaussian noise on their sum.",
                               group="Privacy")
    dp_update_clip: float | None = setting(None, "L2 bound S of a client's model update "
                                           "under --dp-updates.", group="Privacy",
                                           shown="1.0")
    dp_updates_share: float = setting(0.5, "Budget share of --dp-updates beside calibration "
                                      "uploads.", group="Privacy")
    dp_adaptive_clip: bool = setting(False, "Move --dp-update-clip each round towards a "
                                     "quantile of the update norms (noised count).",
                                     group="Privacy")
    dp_clip_quantile: float = setting(0.5, "Target quantile of --dp-adaptive-clip.",
                                      group="Privacy")
    secagg: bool = setting(False, "CKKS secure aggregation.", group="Privacy")
    hide_counts: bool = setting(False, "Hide class counts.", group="Privacy",
                                flag="--hide-counts/--show-counts")
    insecure_seeded_noise: bool = setting(
        False, "INSECURE: draw DP noise from the seed (tests only).", group="Privacy",
        flag="--insecure-seeded-noise")
    secagg_updates: bool = setting(False, "CKKS sums of model updates.", group="Privacy")
    secagg_min_clients: int = setting(
        2, "Fewest uploads a secure aggregate may sum (>= 2); the key holder refuses fewer.",
        group="Privacy")
    secagg_key_holder: int | None = setting(
        None, "Client that also holds the CKKS secret key and sees every sum (Flower sets it "
        "from flower.key-holder): it needs --secagg-min-clients others in every sum.",
        group="Privacy")
    stages: str = setting("", "Extra protection stages a run switches on by their registered "
                          "names, comma-separated (CONTRIBUTING.md, privacy/stage_registry.py).",
                          group="Privacy")
    # outputs
    out: str | None = setting(None, "Run folder (default runs/<method>-<dataset>-<time>).",
                              group="Output", shown="")
    transcript: bool = setting(True, "Record the server's view.", group="Output")

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
            (self.data_seed is None or self.data_seed >= 0, "--data-seed must be >= 0"),
            (self.workers >= 1, "--workers must be >= 1"),
            (self.threads is None or self.threads >= 1, "--threads must be >= 1"),
            (self.client_batch >= 1, "--client-batch must be >= 1"),
            (self.client_batch == 1 or self.workers == 1,
             "--client-batch > 1 trains in this process: give --workers 1 (or --client-batch 1)"),
            (self.client_batch == 1 or not self.dp_train,
             "--client-batch > 1 cannot train with --dp-train: DP-SGD trains clients one at a "
             "time (docs/usage.md); use --client-batch 1"),
            (self.dp_eps == math.inf or 0 < self.dp_eps <= MAX_EPSILON,
             f"--dp-eps must be in (0, {MAX_EPSILON:g}] (omit it for no DP): a larger "
             "epsilon protects nothing"),
            (self.secagg_min_clients >= 2,
             "--secagg-min-clients must be >= 2: a secure aggregate of one is that upload"),
            (self.dp_delta is None or 0 < self.dp_delta < 1, "--dp-delta must be in (0, 1)"),
            (self.dp_clip is None or self.dp_clip > 0, "--dp-clip must be > 0"),
            (self.dp_grad_clip is None or self.dp_grad_clip > 0, "--dp-grad-clip must be > 0"),
            (0 < self.dp_train_share < 1, "--dp-train-share must be in (0, 1)"),
            (self.dp_update_clip is None or (math.isfinite(self.dp_update_clip)
                                             and self.dp_update_clip > 0),
             "--dp-update-clip must be a finite number > 0"),
            (0 < self.dp_updates_share < 1, "--dp-updates-share must be in (0, 1)"),
            (0 < self.dp_clip_quantile < 1, "--dp-clip-quantile must be in (0, 1)"),
            (self.dp_nominal_size is None or self.dp_nominal_size >= 1,
             "--dp-nominal-size must be >= 1"),
            (not self.hide_counts or self.secagg,
             "--hide-counts needs --secagg: only inside ciphertexts are counts hidden"),
        ]
        checks += [(getattr(self, s.name) in s.choices,
                    f"{s.flag_name} must be one of {', '.join(s.choices)}")
                   for s in settings_of(RunConfig, "run") if s.choices]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        self._check_privacy_flags()
        if self.method in METHOD_ALIASES and self.calibrate not in ("none", self.calibrator_of_alias):
            raise UsageError(
                f"--method {self.method} already calibrates with {self.calibrator_of_alias}; "
                f"--calibrate {self.calibrate} would be ambiguous: use --method "
                f"{METHOD_ALIASES[self.method][0]} --calibrate {self.calibrate}")

    def _check_privacy_flags(self) -> None:
        """Privacy settings without the protection they belong to would be ignored, and a
        user would believe them in force: refuse them."""
        dp_only = [("--dp-delta", self.dp_delta is not None),
                   ("--accountant", self.accountant != "rdp")]
        if not self.dp_enabled:
            given = [flag for flag, on in dp_only if on]
            if not self.secagg:  # the clip bounds also size CKKS parameters under --secagg
                given += [flag for flag, on in (("--dp-clip", self.dp_clip is not None),
                                                ("--dp-grad-clip", self.dp_grad_clip is not None))
                          if on]
            if given:
                raise UsageError(f"{', '.join(given)} belong(s) to a DP budget: give --dp-eps")
        if not self.dp_train:
            given = [flag for flag, on in (("--dp-train-share", self.dp_train_share != 0.5),
                                           ("--dp-nominal-size", self.dp_nominal_size is not None))
                     if on]
            if given:
                raise UsageError(f"{', '.join(given)} belong(s) to DP-SGD: give --dp-train")
        if not self.dp_adaptive_clip and self.dp_clip_quantile != 0.5:
            raise UsageError("--dp-clip-quantile belongs to --dp-adaptive-clip")
        if self.dp_adaptive_clip and self.secagg_updates:
            raise UsageError("--dp-adaptive-clip runs with central noise only: under "
                             "--secagg-updates its count would leave the ciphertexts")
        if not self.dp_updates:
            given = [flag for flag, on in (("--dp-update-clip", self.dp_update_clip is not None),
                                           ("--dp-updates-share", self.dp_updates_share != 0.5),
                                           ("--dp-adaptive-clip", self.dp_adaptive_clip))
                     if on]
            if given:
                raise UsageError(f"{', '.join(given)} belong(s) to user-level DP: give "
                                 "--dp-updates")
        elif not self.dp_enabled:
            raise UsageError("--dp-updates needs a budget: give --dp-eps")
        elif self.dp_train:
            raise UsageError("--dp-updates and --dp-train both protect the model updates and "
                             "are accounted apart: choose one (--dp-updates: user level, which "
                             "covers every example of a client; --dp-train: sample level)")
        if not (self.secagg or self.secagg_updates) and self.secagg_min_clients != 2:
            raise UsageError("--secagg-min-clients belongs to secure aggregation: give "
                             "--secagg or --secagg-updates")
        if self.secagg_key_holder is not None:
            if not (self.secagg or self.secagg_updates):
                raise UsageError("--secagg-key-holder belongs to secure aggregation: give "
                                 "--secagg or --secagg-updates")
            if not 0 <= self.secagg_key_holder < self.clients:
                raise UsageError(f"--secagg-key-holder {self.secagg_key_holder} is not a client "
                                 f"(0..{self.clients - 1})")

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
        return cls(**check_settings(d, f"{where}: " if where else ""))

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


def check_settings(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``d`` (RunConfig field names) with every value checked against its setting's type
    (privfedcal/settings/catalogue.py); the ``method_params`` / ``calibration_params`` tables' values
    too, for the names that have a flag (the rest are checked by the method or calibrator).
    Unknown names and wrong types raise a one-line UsageError starting with ``prefix``.
    ``dp_eps = None`` (config.json's "off") is inf."""
    known = {s.name: s for s in settings_of(RunConfig, "run")}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise UsageError(f"{prefix}unknown setting(s) {', '.join(unknown)}; valid names: "
                         f"{', '.join(sorted(known))}")
    out = dict(d)
    if "dp_eps" in out and out["dp_eps"] is None:
        out["dp_eps"] = math.inf
    out = {k: check_value(known[k], v, prefix) for k, v in out.items()}
    # method hyperparameters are checked by the method's own Params (name, type, range)
    # when the run is built: which names are valid depends on the method
    # (the calibrators' flagged options, once privfedcal.calibration is loaded; the
    # calibrator checks them again when it is built, calibration.calibrator_params)
    by_name = {s.name: s for s in calibration_settings()}
    if "calibration_params" in out:
        out["calibration_params"] = {
            k: check_value(by_name[k], v, f"{prefix}calibration_params.") if k in by_name
            else v for k, v in out["calibration_params"].items()}
    return out


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
        if "data_seed" not in raw and "seed" in raw:  # a run from before the data seed
            raw["data_seed"] = raw["seed"]
    return check_settings({k.replace("-", "_"): v for k, v in raw.items()},
                          f"config file {p}: ")


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


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The settings of the run in ``run_dir`` (its ``config.json``, record-only keys
    dropped); a folder without a readable ``config.json`` is a usage error."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a run folder (no {CONFIG_FILE})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path} does not hold a settings object")
    for key in RUN_RECORD_KEYS:
        raw.pop(key, None)
    if "data_seed" not in raw:  # written before the data seed: partitioned with the seed
        raw["data_seed"] = raw.get("seed")
    return RunConfig.from_dict(raw, where=str(path))
