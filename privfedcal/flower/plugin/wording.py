"""The plugin's errors in a Flower user's words: run-config keys, never the CLI's flags.

privfedcal's checks are shared with ``privfedcal train`` and name its flags
(``--dp-eps must be in (0, 100]``). A Flower app has no flags: it sets
``privfedcal.dp-eps`` in its run config or ``dp_eps=`` as a keyword. At the plugin's
boundary (``calibrate``, ``preflight``, ``CalibrationClient``) a message is rewritten
through the one table that maps each flag to its setting (``pysurface.flag_keywords``,
derived from the settings' declarations), with each setting spelled as the plugin's
run-config key (``plugin_key``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from privfedcal.errors import PrivacyBudgetError, UsageError
from privfedcal.flower.plugin.plugin_settings import CALIBRATION, FLOWER_KEYS, PREFIX

__all__ = ["plugin_key", "plugin_message", "speaks_plugin", "user_words"]

F = TypeVar("F", bound=Callable[..., Any])

#: a plugin key already in a message (``privfedcal.dp-eps``): left as it is
_KEY = re.compile(r"privfedcal\.[\w.-]*[\w]")
#: settings whose plugin key is not their name (the key holder is a Flower option)
_ALIASES = {"secagg_key_holder": "flower.key-holder"}


@functools.cache
def _calibration_names() -> frozenset[str]:
    import privfedcal.experiment  # noqa: F401 - registers the calibrators' options
    from privfedcal.descriptions import calibration_settings

    return frozenset(s.name for s in calibration_settings())


def plugin_key(name: str) -> str:
    """A setting's keyword name (``dp_eps``) as the plugin's run-config key
    (``privfedcal.dp-eps``; ``privfedcal.calibration-params.virtual-per-class``)."""
    if name in _ALIASES:
        return PREFIX + _ALIASES[name]
    key = name.replace("_", "-")
    if "flower." + key in FLOWER_KEYS:
        return PREFIX + "flower." + key
    if name in _calibration_names():
        return PREFIX + CALIBRATION + key
    return PREFIX + key


def plugin_message(text: str) -> str:
    """``text`` with every flag of privfedcal's settings as the plugin's key (one table);
    the plugin's keys it already names stay as they are."""
    from privfedcal.pysurface import python_message

    out, pos = [], 0
    for m in _KEY.finditer(text):
        out += [python_message(text[pos:m.start()], spell=plugin_key), m.group()]
        pos = m.end()
    return "".join(out) + python_message(text[pos:], spell=plugin_key)


#: the errors whose message is all they say (a Diverged's hint is the CLI's own)
_WORDED = (UsageError, PrivacyBudgetError)


def user_words(exc: BaseException) -> BaseException:
    """``exc`` with its message rewritten in place as one line, if it is a usage or budget
    error; any other as it is."""
    if isinstance(exc, _WORDED) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (" ".join(plugin_message(str(exc)).split()),)
    return exc


@contextmanager
def speaks_plugin() -> Iterator[None]:
    """Errors raised inside leave in the plugin's words (``user_words``)."""
    try:
        yield
    except _WORDED as exc:
        raise user_words(exc) from None
