"""How a setting is described: its name, type, default, help text, help group and flag.

``setting(...)`` makes a described dataclass field (``RunConfig``'s, ``FlowerOptions``'),
``settings_of`` reads the descriptions back, ``check_value`` checks a value against one. The
catalogue of every setting and what is derived from it (CLI options, TOML keys, the Flower
run config, the docs' tables) is ``privfedcal/settings/catalogue.py``, which sits above
``privfedcal/settings/run_config.py``: the description comes first, the config is made of it, the
catalogue reads the config.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, cast

from privfedcal.errors import UsageError
from privfedcal.settings.messages import SettingText, declare_spelling, refuse_failed

#: help groups, in the order ``train --help`` and the docs table show them
GROUPS = ("Method", "Data", "Training", "Hardware", "Method hyperparameters", "Calibration",
          "Privacy", "Output", "Flower")
SCOPES = ("run", "method", "calibration", "flower")
#: shown as the default of a setting resolved per model (docs/usage.md, "Defaults per model")
PER_MODEL = "per model, see docs/usage.md"


@dataclass(frozen=True)
class Setting:
    """One setting: what every place that reads or shows settings is derived from.

    ``type`` is int, float, str, bool or dict (a table of hyperparameters); ``optional``:
    None is a valid value (unset: resolved later, or the method's/calibrator's default).
    ``flag``: typer's declaration when not the plain ``--name`` (``--name/--no-name`` for
    booleans); ``shown``: the default as help and docs print it when not the value itself
    ("" shows none); ``cli``: whether ``privfedcal train`` has a flag for it; ``section``:
    the attribute of ``RunConfig`` whose section declares it ("": a field of its own).
    """

    name: str
    type: type
    default: Any
    help: str
    group: str
    scope: str = "run"
    optional: bool = False
    flag: str | None = None
    shown: str | None = None
    choices: tuple[str, ...] | None = None
    cli: bool = True
    section: str = ""

    def __post_init__(self) -> None:
        assert self.group in GROUPS and self.scope in SCOPES, (self.name, self.group)

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def param_decls(self) -> tuple[str, ...]:
        """typer/click declarations of the flag."""
        if self.flag:
            return (self.flag,)
        if self.type is bool:
            return (f"{self.flag_name}/--no-{self.flag_name[2:]}",)
        return ()

    @property
    def shown_default(self) -> str:
        """The default as ``--help`` and the docs show it."""
        if self.shown is not None:
            return self.shown
        return render(self.default)


def render(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def setting(default: Any, help: str, *, group: str, flag: str | None = None,
            shown: str | None = None, choices: tuple[str, ...] | None = None,
            cli: bool = True, factory: Any = None) -> Any:
    """A dataclass field that carries its description (read back by :func:`settings_of`)."""
    meta = {"setting": {"help": help, "group": group, "flag": flag, "shown": shown,
                        "choices": choices, "cli": cli}}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def refuse_bad_choices(section: Any, declared: type) -> None:
    """Each setting ``declared`` with ``choices`` holds one of them in ``section``."""
    refuse_failed([(getattr(section, s.name) in s.choices,
                    SettingText("{setting} must be one of {choices}",
                                setting=SettingText.named([s.name]), choices=", ".join(s.choices)))
                   for s in settings_of(declared, "run") if s.choices])


def field_kind(annotation: Any) -> tuple[type, bool]:
    """(base type, optional) of a field annotation such as ``int | None``: how settings and
    the API's keyword options (``api.arguments.options_of``) check a value."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        (annotation,) = args
    base = typing.get_origin(annotation) or annotation
    return base, optional


def section(cls: type) -> Any:
    """A dataclass field holding the settings section ``cls`` (its defaults by default);
    :func:`settings_of` lists the section's settings in its place."""
    return field(default_factory=cls, metadata={"section": cls})


def _default_of(f: dataclasses.Field[Any]) -> Any:
    """A setting field's default: its value, else its factory's product."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"setting {f.name!r} declares no default")
    return f.default_factory()


@functools.cache
def settings_of(cls: type, scope: str) -> tuple[Setting, ...]:
    """The settings declared by ``cls``'s fields, in field order; a section field
    (:func:`section`) contributes its section's settings, each knowing its section."""
    hints = typing.get_type_hints(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            out += [dataclasses.replace(s, section=f.name)
                    for s in settings_of(f.metadata["section"], scope)]
            continue
        meta = f.metadata["setting"]
        kind, optional = field_kind(hints[f.name])
        default = _default_of(f)
        out.append(Setting(f.name, kind, default, scope=scope, optional=optional, **meta))
    for s in out:
        declare(s)
    return tuple(out)


def declare(s: Setting) -> None:
    """Record how ``s`` is spelled, for the messages that name it (settings/messages.py)."""
    declare_spelling(s.name, s.type, s.param_decls[0] if s.param_decls else None)


def _hyper(name: str, kind: type, help: str, *, scope: str, flag: str | None = None) -> Setting:
    group, shown = (("Method hyperparameters", "the method's") if scope == "method"
                    else ("Calibration", "the calibrator's"))
    return Setting(name, kind, None, help, group, scope=scope, optional=True, flag=flag,
                   shown=shown)


def calibration_option(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A field of a calibrator's ``Params`` that ``privfedcal train`` has a flag for (and a
    ``[calibration_params]`` key): ``--<field>``, or ``--<flag>`` for a name prefixed with
    the calibrator's (``creff_weighting`` for CReFF's ``weighting``: the calibrator reads
    either spelling); its type is the field's, and None on the CLI keeps the calibrator's
    default. ``calibration_settings`` lists every registered calibrator's."""
    return field(default=default, metadata={"calibration_option": {"help": help, "flag": flag}})


#: calibrator options with a flag, in registration order (``register_calibration_options``)
_CALIBRATION_OPTIONS: dict[str, Setting] = {}


def calibration_options(params: type) -> tuple[Setting, ...]:
    """The ``calibration_option`` fields of a calibrator's ``Params``, as settings."""
    hints = typing.get_type_hints(params)
    out = []
    for f in dataclasses.fields(params):
        meta = f.metadata.get("calibration_option")
        if meta is not None:
            kind, _ = field_kind(hints[f.name])
            out.append(_hyper(meta["flag"] or f.name, kind, meta["help"], scope="calibration"))
    return tuple(out)


def register_calibration_options(params: type) -> None:
    """Add a calibrator's options (``calibration_options``) to ``calibration_settings``;
    ``privfedcal.calibration`` registers every calibrator's when it is imported (the
    calibrators sit above this module, as the methods above ``settings.catalogue.method_settings``).
    A name two calibrators share must mean one setting."""
    for s in calibration_options(params):
        if _CALIBRATION_OPTIONS.setdefault(s.name, s) != s:
            raise TypeError(f"calibration option {s.name!r} is declared twice, differently")


def calibration_settings() -> tuple[Setting, ...]:
    """The calibrator options with a flag (``[calibration_params]``) of every registered
    calibrator (empty until ``privfedcal.calibration`` is imported); None: the
    calibrator's default."""
    return tuple(_CALIBRATION_OPTIONS.values())


#: the longest ``flower.hold``: Flower 1.41's SuperNode sleeps 3 s after an empty pull, so a
#: longer hold could only be slower than no hold at all
HOLD_CAP = 3.0


@dataclass(frozen=True)
class FlowerOptions:
    """Flower-only settings (``flower.*`` run-config keys)."""

    round_timeout: float = setting(
        3600.0, "Seconds to wait for all replies of one exchange before the round fails.",
        group="Flower", cli=False)
    poll_interval: float = setting(0.2, "Seconds between two pulls of replies from the SuperLink.",
                                   group="Flower", cli=False)
    node_wait: float = setting(300.0, "Seconds the ServerApp waits for `clients` SuperNodes to "
                               "connect.", group="Flower", cli=False)
    key_holder: int = setting(0, "With --secagg: the client whose SuperNode holds the CKKS "
                              "secret key.", group="Flower", cli=False)
    min_replies: int = setting(
        0, "Fewest clients of a round whose replies let it go on without the others (lost "
        "nodes are dropped and named in the summary); 0: every selected client must reply. "
        "Never below --secagg-min-clients + 1 for a secure sum (m others besides the key "
        "holder's own upload); the key holder is always needed.",
        group="Flower", cli=False)
    hold: float = setting(
        0.0, "Seconds of margin for a follow-up `query.hold` message that keeps each SuperNode "
        "busy after it replies, so that its next pull finds the next message instead of "
        "Flower's 3 s idle sleep (the hold waits the node's expected wait less a hold's "
        "measured cost, plus this; at most 3 s; 0.5 worked best on loopback). 0: no hold "
        "messages. Pays with the warm launcher only (docs/flower.md).",
        group="Flower", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.min_replies, bool) or not isinstance(self.min_replies, int) \
                or self.min_replies < 0:
            raise UsageError(f"flower.min-replies must be an integer >= 0, got "
                             f"{self.min_replies!r}")
        if isinstance(self.key_holder, bool) or not isinstance(self.key_holder, int) \
                or self.key_holder < 0:
            raise UsageError(f"flower.key-holder must be a client index >= 0, got "
                             f"{self.key_holder!r}")
        for name in ("round_timeout", "poll_interval", "node_wait"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0):
                raise UsageError(f"flower.{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {value!r}")
        if not (isinstance(self.hold, int | float) and not isinstance(self.hold, bool)
                and 0 <= self.hold <= HOLD_CAP):
            raise UsageError(f"flower.hold must be a number of seconds in [0, {HOLD_CAP:g}], "
                             f"got {self.hold!r}")


# ---- types ----------------------------------------------------------------------------
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def check_value(s: Setting, value: Any, prefix: str = "") -> Any:
    """``value`` if it has ``s``'s type (ints widen to float; None where optional), else a
    one-line UsageError naming the setting. Tables get their names normalised to ``_``."""
    if value is None and s.optional:
        return None
    if s.type is dict:
        if not isinstance(value, dict):
            raise UsageError(f"{prefix}{s.name} must be a table of name = value, got {value!r}")
        return {k.replace("-", "_"): v for k, v in value.items()}
    accepted = (int, float) if s.type is float else (s.type,)
    if not isinstance(value, accepted) or (s.type is not bool and isinstance(value, bool)):
        raise UsageError(f"{prefix}{s.name} must be {_KIND_NAMES[s.type]}, got {value!r}")
    return float(cast("int | float", value)) if s.type is float else value


# ---- Flower run config -------------------------------------------------------------------
#: run-config key prefixes of the three non-run scopes
