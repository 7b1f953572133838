"""An attack's options: a frozen dataclass per attack, whose fields carry their help text.

Each attack declares its options type beside its planner and registers it with the attack
(``release_attacks.ReleaseAttack.options``). The fields, made by ``attack_option``, are the
one place an option is described: ``privfedcal attack``'s flags (``--raw-samples``: the
field's name, its help text and default), the keywords of ``privfedcal.attack`` and the
leakage sweep's settings are read from them; the type's ``__post_init__`` checks the values.
A field made with ``cli=False`` is set by the library only (the sweep's ``known_classes``
side knowledge is a flag, its ``default_clients`` is not).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from privfedcal.errors import UsageError


def attack_option(default: Any, help: str, *, flag: str | None = None,
                  cli: bool = True) -> Any:
    """A described options field: ``flag`` is the CLI's spelling when not ``--<name>``
    (``--totals/--no-totals``); ``cli=False`` keeps it off the command line."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "flag": flag, "cli": cli})


@dataclass(frozen=True)
class OptionFlag:
    """One described field of an options type, as the CLI and the API read it."""

    name: str
    type: type  # int, float, str or bool
    optional: bool  # None is a valid value
    default: Any
    help: str
    flag: str | None
    cli: bool

    @property
    def decls(self) -> tuple[str, ...]:
        """typer/click declarations: the field's flag, ``--name`` by default (a boolean
        without one is an on-switch, as ``--known-classes``)."""
        return (self.flag or "--" + self.name.replace("_", "-"),)


def _kind(annotation: Any) -> tuple[type, bool]:
    """(base type, optional) of ``int``, ``int | None``, ..."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (base,) = [a for a in args if a is not type(None)]
        return base, True
    return annotation, False


@dataclass(frozen=True)
class NoOptions:
    """The options type of an attack that takes none."""


def option_flags(options: type) -> tuple[OptionFlag, ...]:
    """The described fields of an options type, in declaration order."""
    hints = typing.get_type_hints(options)
    out = []
    for f in dataclasses.fields(options):
        if "help" not in f.metadata:
            raise TypeError(f"{options.__name__}.{f.name} is not made by attack_option")
        kind, optional = _kind(hints[f.name])
        out.append(OptionFlag(f.name, kind, optional, f.default, f.metadata["help"],
                              f.metadata["flag"], f.metadata["cli"]))
    return tuple(out)


def make_options(options: type, values: Mapping[str, Any], what: str) -> Any:
    """``options(**values)``; a key that is no field of it is a one-line ``UsageError``
    naming the valid ones (``what``: whose options, for the message)."""
    names = [f.name for f in dataclasses.fields(options)]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise UsageError(f"{what} takes no option {', '.join(map(repr, unknown))} (its "
                         f"options: {', '.join(names) or 'none'})")
    return options(**values)


def options_from(options: type, values: Mapping[str, Any]) -> Any:
    """``options`` built from the entries of ``values`` that are fields of it (the others
    are left for other attacks): the sweep's settings, given once for every attack."""
    names = {f.name for f in dataclasses.fields(options)}
    return options(**{k: v for k, v in values.items() if k in names})


def with_defaults(flags: Iterable[OptionFlag], names: Iterable[str],
                  defaults: Mapping[str, Any]) -> tuple[OptionFlag, ...]:
    """The fields ``names`` of ``flags``, in that order, with ``defaults`` replacing their
    declared defaults: a command that takes some of an attack's options with defaults of
    its own (``privfedcal audit``'s inversion options) declares only the difference."""
    by_name, names = {f.name: f for f in flags}, tuple(names)
    wrong = [n for n in (*names, *defaults) if n not in by_name or n not in names]
    if wrong:
        raise TypeError(f"option fields not declared, or overridden but not taken: {wrong}")
    return tuple(dataclasses.replace(by_name[n], default=defaults.get(n, by_name[n].default))
                 for n in names)


def merged_flags(types_: Iterable[type]) -> dict[str, OptionFlag]:
    """Every CLI field of the options types by name, first declaration first; a name that
    two types declare differently (type or default) is an error of the declarations."""
    out: dict[str, OptionFlag] = {}
    for options in types_:
        for f in option_flags(options):
            if not f.cli:
                continue
            seen = out.setdefault(f.name, f)
            if (seen.type, seen.default) != (f.type, f.default):
                raise TypeError(f"option {f.name!r} is declared twice, differently "
                                f"({seen.type.__name__} = {seen.default!r}, "
                                f"{f.type.__name__} = {f.default!r})")
    return out


__all__ = ["NoOptions", "OptionFlag", "attack_option", "make_options", "merged_flags", "option_flags",
           "options_from", "with_defaults"]
