"""Every setting of a run, in one frozen dataclass made of sections: the one place that
holds the defaults.

Each field of ``RunConfig`` and of its sections (privfedcal/settings/sections.py) is also the
setting's description (help, group, flag; privfedcal/settings/descriptions.py), from which the
CLI options, settings-file checks, the Flower run config and the docs' settings table are
derived. Settings are named flat at the edges (flags, settings files, ``config.json``, the
Python API's keywords): ``RunConfig.of`` places each in its section, ``to_dict`` flattens.

CLI flags and ``--config FILE`` (TOML, or a run's own ``config.json``) map onto ``RunConfig``
(flags override the file); ``config.json`` in the run folder is the *resolved*
``RunConfig.to_dict()`` plus versions. Settings left ``None`` (model, optimiser, local epochs,
augmentation) are resolved per model and dataset by :func:`resolve_training_defaults` from
``TRAINING_DEFAULTS`` (docs/usage.md, "Defaults per model").
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfedcal.errors import UsageError
from privfedcal.settings.descriptions import (
    calibration_settings,
    check_value,
    refuse_failed,
    section,
    setting,
    settings_of,
)
from privfedcal.settings.messages import SettingError, SettingText
from privfedcal.settings.sections import (
    SECTIONS,
    DataSettings,
    EngineSettings,
    OutputSettings,
    PrivacySettings,
    TrainingSettings,
)

#: ``--method`` shorthands: (local method, calibrator)
METHOD_ALIASES: dict[str, tuple[str, str]] = {
    "ccvr": ("fedavg", "ccvr"),
    "creff": ("fedavg", "creff"),
}

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
    """A whole experiment: what names the run (method, model, calibrator and their
    parameters) and one section of each kind (privfedcal/settings/sections.py). Build it
    from flat setting names with :meth:`of`; ``to_dict`` is the flat ``config.json``."""

    # what to train
    method: str = setting("fedavg", "Local method or shorthand (ccvr, creff).", group="Method")
    model: str | None = setting(None, "Model (default: the dataset's).", group="Method",
                                shown="the dataset's, see docs/usage.md")
    method_params: dict[str, Any] = setting(
        None, "Method hyperparameters by name (None: the method's default).",
        group="Method hyperparameters", factory=dict, cli=False, shown="{}")
    data: DataSettings = section(DataSettings)
    training: TrainingSettings = section(TrainingSettings)
    engine: EngineSettings = section(EngineSettings)
    calibrate: str = setting("none", "none | ccvr[:N] | creff[:N] | oracle[:N]; N: CCVR's "
                             "virtual features per class (--virtual-per-class), CReFF's "
                             "federated features per class (--features-per-class), the "
                             "oracle's real features per class (default all).",
                             group="Calibration")
    calibration_params: dict[str, Any] = setting(
        None, "Calibrator options by name (None: the calibrator's default).",
        group="Calibration", factory=dict, cli=False, shown="{}")
    privacy: PrivacySettings = section(PrivacySettings)
    output: OutputSettings = section(OutputSettings)

    def __post_init__(self) -> None:
        """The rules that span two sections (each section checks its own)."""
        refuse_failed([
            (self.engine.client_batch == 1 or not self.privacy.dp_train,
             SettingText("{client_batch} > 1 cannot train with {dp_train}: DP-SGD trains clients "
                         "one at a time (docs/usage.md); use {client_batch=}", client_batch=1)),
        ])
        holder = self.privacy.secagg_key_holder
        if holder is not None and not 0 <= holder < self.data.clients:
            raise SettingError("{secagg_key_holder=} is not a client (0..{last})",
                               secagg_key_holder=holder, last=self.data.clients - 1)
        if self.method in METHOD_ALIASES and self.calibrate not in ("none", self.calibrator_of_alias):
            instead = SettingText("{method=} {calibrate=}", method=METHOD_ALIASES[self.method][0],
                                  calibrate=self.calibrate)
            raise SettingError("{method=} already calibrates with {calibrator}; {calibrate=} "
                               "would be ambiguous: use {instead}", method=self.method,
                               calibrator=self.calibrator_of_alias, calibrate=self.calibrate,
                               instead=instead)

    @classmethod
    def of(cls, **flat: Any) -> RunConfig:
        """The run of the settings ``flat`` names (``dp_eps=8``, ``clients=5``: the CLI
        flags' names), every other setting at its default; each section checks its rules."""
        where = _section_of_name()
        unknown = sorted(set(flat) - set(where))
        if unknown:
            raise TypeError(f"RunConfig.of() got unknown setting(s) {', '.join(unknown)}")
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        own: dict[str, Any] = {}
        for name, value in flat.items():
            (parts[where[name]] if where[name] else own)[name] = value
        return cls(**own, **{name: SECTIONS[name](**kw) for name, kw in parts.items()})

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
        return self.privacy.dp_enabled

    # ---- (de)serialisation ------------------------------------------------------------
    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name, in declaration order (the values themselves)."""
        return {s.name: getattr(getattr(self, s.section) if s.section else self, s.name)
                for s in settings_of(RunConfig, "run")}

    def to_dict(self) -> dict[str, Any]:
        """The flat settings as ``config.json`` writes them (``dp_eps`` off is null)."""
        d = copy.deepcopy(self.flat())
        d["dp_eps"] = None if not self.privacy.dp_enabled else self.privacy.dp_eps
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "") -> RunConfig:
        """Build from plain values (a TOML/JSON file, flags); unknown names and wrong types
        raise a one-line UsageError (``where`` prefixes it, e.g. the file name)."""
        return cls.of(**check_settings(d, f"{where}: " if where else ""))

    def replace(self, **changes: Any) -> RunConfig:
        """This run with the settings ``changes`` names (flat names) changed."""
        return RunConfig.of(**{**self.flat(), **changes})


def _flat_reader(section: str, name: str) -> property:
    return property(lambda cfg: getattr(getattr(cfg, section), name),
                    doc=f"``{section}.{name}``, read by its flat name.")


# The Python API's users read a run's settings by their flat names (``run.config.rounds``,
# docs/api.md), as they give them: each section setting is also a read-only attribute of
# ``RunConfig``. Added after the class, so type checkers see only the sections: the package
# itself reads ``cfg.training.rounds``.
for _s in settings_of(RunConfig, "run"):
    if _s.section:
        if hasattr(RunConfig, _s.name):
            raise TypeError(f"setting {_s.name!r} of section {_s.section} would hide "
                            f"RunConfig.{_s.name}")
        setattr(RunConfig, _s.name, _flat_reader(_s.section, _s.name))


_sections_init = RunConfig.__init__


def _init(self: RunConfig, *args: Any, **given: Any) -> None:
    """``RunConfig``'s constructor: sections, or flat setting names (``RunConfig(dp_eps=8)``,
    as the config took them when it was flat), or both (``dataclasses.replace(cfg,
    rounds=3)`` passes the sections with a flat name): each flat name lands in its section,
    over the section given or its defaults."""
    where = _section_of_name()
    parts: dict[str, dict[str, Any]] = {}
    own: dict[str, Any] = {}
    for name, value in given.items():
        if where.get(name):
            parts.setdefault(where[name], {})[name] = value
        else:
            own[name] = value
    for name, values in parts.items():
        base = own.get(name)
        own[name] = SECTIONS[name](**values) if base is None else dataclasses.replace(
            base, **values)
    _sections_init(self, *args, **own)


RunConfig.__init__ = _init  # type: ignore[method-assign]


@functools.cache
def _section_of_name() -> dict[str, str]:
    """Each flat setting name -> the ``RunConfig`` section attribute holding it ("": a
    field of ``RunConfig`` itself)."""
    return {s.name: s.section for s in settings_of(RunConfig, "run")}


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
    changes: dict[str, Any] = {k: v for k, v in table.items()
                               if getattr(cfg.training, k) is None}
    if cfg.model is None:
        changes["model"] = model
    if cfg.data.augment is None:
        changes["augment"] = augment
    return cfg.replace(**changes) if changes else cfg


def resolved_line(cfg: RunConfig) -> str:
    """One line naming the resolved model and local-training settings."""
    t = cfg.training
    return (f"model {cfg.model}, lr {t.lr:g}, momentum {t.momentum:g}, weight decay "
            f"{t.weight_decay:g}, batch {t.batch_size}, local epochs {t.local_epochs}, "
            f"augment {'on' if cfg.data.augment else 'off'}")


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
