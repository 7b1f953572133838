"""An attack's options type as typer flags, and the flags given back as its options.

Each registered attack declares its options as a frozen dataclass of described fields
(``attacks/attack_options.py``); ``privfedcal attack``'s commands take those fields as
flags (``option_parameters``), build the chosen attack's options from the flags given
(``given_options``; ``options_given`` for a command's own options type, as ``attack
classes``' ``ClassesOptions``: the type's ``__post_init__`` checks them) and refuse a flag
of an attack that was not chosen (``refuse_strays``). ``privfedcal audit`` takes its
inversion options the same way (``inversion_options.audit_flags``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Annotated, Any

import typer

from privfedcal.errors import UsageError

Opt = typer.Option
KEYWORD = inspect.Parameter.KEYWORD_ONLY


def option_parameters(flags: Iterable[Any]) -> list[inspect.Parameter]:
    """typer options for options-type fields (``attacks/attack_options.py`` ``OptionFlag``): the
    field's flag, help and default. A value flag not given is None (the attack's default
    then applies); a switch defaults to the field's default."""
    params = []
    for f in flags:
        ann: Any
        if f.type is bool:
            ann = Annotated[bool, Opt(*f.decls, help=f.help)]
            default = f.default
        else:
            shown = "none" if f.default is None else f.default
            ann = Annotated[f.type | None, Opt(*f.decls, help=f"{f.help} (default {shown})",
                                               show_default=False)]
            default = None
        params.append(inspect.Parameter(f.name, KEYWORD, default=default, annotation=ann))
    return params


def given_options(attack: Any, flags: dict[str, Any]) -> Any:
    """``attack``'s options from the flags: each of its CLI fields that was given (a switch:
    its value)."""
    return options_given(attack.options, flags, f"attack {attack.name}")


def options_given(options: type, flags: dict[str, Any], what: str) -> Any:
    """An options type built from the flags: each of its CLI fields that was given (a
    switch: its value); the others keep the type's defaults, its checks run (``what``: the
    command, for the message)."""
    from privfedcal.attacks.attack_options import make_options, option_flags

    given = {f.name: flags[f.name] for f in option_flags(options)
             if f.cli and flags.get(f.name) is not None}
    return make_options(options, given, what)


def refuse_strays(chosen: list[Any], flags: dict[str, Any], offered: dict[str, Any],
                  offered_by: list[Any]) -> None:
    """A flag of an attack that was not chosen (a value given, a switch turned) is refused,
    naming the attacks of ``offered_by`` it belongs to."""
    from privfedcal.attacks.attack_options import option_flags

    mine = {f.name for a in chosen for f in option_flags(a.options)}
    for name, f in offered.items():
        if name not in mine and flags.get(name) not in (None, f.default):
            owners = [a.name for a in offered_by if name in
                      {g.name for g in option_flags(a.options)}]
            raise UsageError(f"{f.decls[0]} is an option of "
                             f"{' or '.join('--' + o for o in owners)}, not of "
                             f"{' '.join('--' + a.name for a in chosen)}")
