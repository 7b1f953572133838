"""The Python surface of privfedcal's API: arguments checked and made plain by their
annotations, and errors that name keywords instead of the CLI's flags.

The library's checks are shared with the CLI. A check that refuses a setting names it
through its declaration (``SettingError``, privfedcal/settings/messages.py), which the CLI
prints as its flag (``--dp-eps``). Each public function of the API
(``privfedcal/api/__init__.py`` and the modules it re-exports) is wrapped by
``python_surface``: its arguments become plain Python values (numpy and 0-d torch scalars
included, checked against the parameter's annotation), and an error it raises is rendered
for Python, naming keywords (``dp_eps``), so that a new setting is named without a line here
(tests/package/test_api_errors.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch
from torch import Tensor

from privfedcal.errors import Diverged, PrivacyBudgetError, UsageError
from privfedcal.settings.messages import SettingText, declare_spelling, render_message
from privfedcal.settings.run_config import RunConfig

P = ParamSpec("P")
R = TypeVar("R")

_KIND_WORDS = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


@dataclass(frozen=True)
class Keyword:
    """What a flag is in Python: the keyword, its type and, for a boolean flag, the value
    the flag sets (``--show-counts`` is ``hide_counts=False``)."""

    name: str
    type: type
    value: bool | None = None


@functools.cache
def flag_keywords() -> dict[str, Keyword]:
    """Every flag of ``privfedcal train``'s settings and of ``privfedcal attack``'s options
    (the fields of every registered attack's options type), by its spelling: ``--dp-eps``
    is ``dp_eps``."""
    from privfedcal.attacks.attack_options import option_flags
    from privfedcal.attacks.release_attacks import registered
    from privfedcal.settings.catalogue import cli_settings

    table: dict[str, Keyword] = {}
    for f in (f for a in registered() for f in option_flags(a.options)):
        on, _, off = (f.flag or "--" + f.name.replace("_", "-")).partition("/")
        table.setdefault(on, Keyword(f.name, f.type, True if f.type is bool else None))
        if f.type is bool:
            table.setdefault(off or "--no-" + on[2:], Keyword(f.name, bool, False))
        declare_spelling(f.name, f.type, f.flag, replace=False)
    for s in cli_settings():  # a setting's spelling wins over an attack option's
        if s.type is bool:
            on, _, off = (s.param_decls or (s.flag_name,))[0].partition("/")
            table[on] = Keyword(s.name, bool, True)
            if off:
                table[off] = Keyword(s.name, bool, False)
        else:
            table[s.flag_name] = Keyword(s.name, s.type)
    return table


def plain_value(value: Any) -> Any:
    """A numpy scalar or a 0-d tensor as the Python value it holds."""
    if isinstance(value, np.generic) or (isinstance(value, Tensor) and value.ndim == 0):
        return value.item()
    return value


def coerce(value: Any, kind: type | None, name: str, optional: bool = True) -> Any:
    """``value`` as a plain ``kind`` (int, float, bool or str; other kinds: only made
    plain). An int never from a bool or from a float with a fraction; None only where
    ``optional`` (a setting's None is judged by its own check)."""
    value = plain_value(value)
    if value is None and optional or kind not in _KIND_WORDS:
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is bool or kind is str:
        ok = isinstance(value, kind)
    else:
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok:
        raise UsageError(f"{name} must be {_KIND_WORDS[kind]}, got {value!r}")
    return float(value) if kind is float else value


def as_path(value: Any, name: str, optional: bool) -> Path | None:
    """A path argument (a str or a ``PathLike``) as a ``Path``; None only where ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise UsageError(f"{name} must be a path (a str or a Path), got {value!r}")


def _as_ints(value: Any, name: str, optional: bool) -> list[int] | None:
    if value is None and optional:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise UsageError(f"{name} must be a list of integers, got {value!r}")
    return [coerce(v, int, f"{name}[{i}]", False) for i, v in enumerate(value)]


def check_that(test: Callable[[Any], bool], what: str) -> Callable[[Any, str, bool], Any]:
    def check(value: Any, name: str, optional: bool) -> Any:
        if (value is None and optional) or test(value):
            return value
        raise UsageError(f"{name} must be {what}, got {type(value).__name__}")
    return check


#: how each parameter annotation of a public function is checked (the annotation without
#: ``| None``); an annotation missing here fails at import, so none goes unchecked. A module
#: of the API with a type of its own adds its check with ``register_check``.
_CHECKS: dict[str, Callable[[Any, str, bool], Any]] = {
    "int": lambda v, n, o: coerce(v, int, n, o),
    "float": lambda v, n, o: coerce(v, float, n, o),
    "str": lambda v, n, o: coerce(v, str, n, o),
    "str | Path": as_path,
    "Iterable[int]": _as_ints,
    "RunConfig | Mapping[str, Any] | str | Path": check_that(
        lambda v: isinstance(v, (RunConfig, Mapping, str, os.PathLike)),
        "a RunConfig, a mapping of settings or a settings file"),
    "Callable[[dict[str, Any]], None]": check_that(callable, "callable"),
    "Callable[[Progress], None]": check_that(callable, "callable"),
    "Tensor": check_that(lambda v: isinstance(v, Tensor), "a torch.Tensor (torch.from_numpy(a))"),
    "Mapping[str, Tensor]": check_that(
        lambda v: isinstance(v, Mapping) and all(isinstance(t, Tensor) for t in v.values()),
        "a mapping of names to torch tensors"),
    "FeatureClassifier": check_that(
        lambda v: isinstance(v, torch.nn.Module) and hasattr(v, "features")
        and hasattr(v, "classifier"), "a FeatureClassifier (features(x) and a classifier head)"),
}


def register_check(annotation: str, check: Callable[[Any, str, bool], Any]) -> None:
    """Check parameters annotated ``annotation`` (as ``str()`` of the annotation shows it,
    without ``| None``) with ``check(value, name, optional)``, which returns the value to
    pass on or raises ``UsageError``."""
    _CHECKS[annotation] = check


def speak_python(exc: BaseException) -> None:
    """``exc``'s message (and a divergence's hint) written in keywords, in place: each
    ``SettingText`` in it rendered for Python (privfedcal/settings/messages.py)."""
    flag_keywords()  # every setting and attack option has declared its spelling
    if isinstance(exc, Diverged):
        if isinstance(exc.hint, SettingText):
            cli, exc.hint = str(exc.hint), exc.hint.render("python")
            exc.args = (str(exc).removesuffix(cli) + exc.hint,)
        return
    exc.args = (render_message(exc, "python"),)


def python_surface(func: Callable[P, R]) -> Callable[P, R]:
    """``func`` as Python callers see it: arguments checked and made plain by their
    annotations (``_CHECKS``), a wrong call a ``UsageError``, and the message of a usage,
    budget or divergence error rendered in keywords (``speak_python``). The CLI calls the
    functions' halves for it (``api.resume_simulator_for_cli``, ``jobs.compare_for_cli``),
    whose messages keep its flags."""
    sig = inspect.signature(func)
    checks = {name: (_CHECKS[str(p.annotation).removesuffix(" | None")],
                     str(p.annotation).endswith("| None"))
              for name, p in sig.parameters.items()
              if p.annotation is not p.empty and p.kind is not p.VAR_KEYWORD}

    @functools.wraps(func)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise UsageError(f"{func.__name__}(): {exc}") from None
        for name, (check, optional) in checks.items():
            if name in bound.arguments:
                bound.arguments[name] = check(bound.arguments[name], name, optional)
        try:
            return func(*bound.args, **bound.kwargs)
        except (UsageError, PrivacyBudgetError, Diverged) as exc:
            speak_python(exc)
            raise
    return call


def options_of(cls: type, given: Mapping[str, Any], what: str,
             taken: Iterable[str] = ()) -> dict[str, Any]:
    """``given`` checked as keyword arguments of the dataclass ``cls`` (less the names
    ``taken`` by the function itself): an unknown name is a UsageError listing the valid
    ones, each value plain and of its field's type."""
    from privfedcal.settings.descriptions import field_kind

    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in set(taken)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise UsageError(f"unknown {what} {', '.join(unknown)}; valid names: {', '.join(names)}")
    out = {}
    for k, v in given.items():
        kind, optional = field_kind(hints[k])
        out[k] = coerce(v, kind, k, optional)
    return out
