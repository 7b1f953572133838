"""The plugin's boundary with a Flower app: errors in the user's words, the app's logging
and threads left as they were.

Errors name run-config keys, never the CLI's flags.
privfedcal's checks are shared with ``privfedcal train``, whose user reads
``--dp-eps must be in (0, 100]``. A Flower app has no flags: it sets ``privfedcal.dp-eps``
in its run config or ``dp_eps=`` as a keyword. A check names a setting through its
declaration (``SettingError``, privfedcal/settings/messages.py), and at the plugin's
boundary (``calibrate``, ``preflight``, ``CalibrationClient``) the message is rendered for
the Flower reader with each setting spelled as the plugin's run-config key
(``plugin_key``).

Logging: opacus configures the root logger when first imported (``logging.basicConfig`` in
``opacus/utils/module_utils.py``), and Flower's log lines, which propagate to the root,
would then print twice. The plugin's entry points keep the root logger's handlers and level
as they found them (``boundary``).

Threads: the plugin computes in the calling process (the ServerApp's, the ClientApp's) with
torch's thread count as the app left it, unless ``privfedcal.threads`` (``threads=``) sets
one for the plugin's own work (``torch_threads``); TenSEAL's CKKS runs on one thread.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from privfedcal.errors import PrivacyBudgetError, UsageError
from privfedcal.flower.link import FlowerRoundError
from privfedcal.flower.plugin.plugin_settings import CALIBRATION, FLOWER_KEYS, PREFIX
from privfedcal.settings.messages import render_message

__all__ = ["boundary", "keep_root_logger", "plugin_key", "plugin_message", "speaks_plugin",
           "threads_setting", "torch_threads", "user_words"]


#: settings whose plugin key is not their name (the key holder is a Flower option)
_ALIASES = {"secagg_key_holder": "flower.key-holder"}


@functools.cache
def _calibration_names() -> frozenset[str]:
    import privfedcal.experiment  # noqa: F401 - registers the calibrators' options
    from privfedcal.settings.descriptions import calibration_settings

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


def plugin_message(text: Any) -> str:
    """A message (an error, or its text) as the plugin's user reads it: each setting a
    ``SettingText`` names spelled as the plugin's key; other text as it is."""
    from privfedcal.api.arguments import flag_keywords

    flag_keywords()  # every setting and attack option has declared its spelling
    return render_message(text, "flower", plugin_key)


#: the errors whose message is all they say (a Diverged's hint is the CLI's own); a lost
#: node's (FlowerRoundError) gets what to change for each error code it names
_WORDED: tuple[type[BaseException], ...] = (UsageError, PrivacyBudgetError, FlowerRoundError)


def _code_fixes(text: str) -> str:
    """What to change for each node error code ``text`` names, as "; code: fix"."""
    from privfedcal.flower.plugin.preflight_codes import ERROR_FIX

    words = set("".join(c if c.isalnum() or c in "_-" else " " for c in text).split())
    named = [c for c in ERROR_FIX if c.value in words]
    return "".join(f"; {c.value}: {ERROR_FIX[c]}" for c in named)


def user_words(exc: BaseException) -> BaseException:
    """``exc`` with its message rewritten in place as one line, if it is a usage, budget or
    lost-node error (the latter with what to change for each node error code it names); any
    other as it is."""
    if isinstance(exc, _WORDED) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = plugin_message(exc)
        if isinstance(exc, FlowerRoundError):
            text += _code_fixes(text)
        exc.args = (" ".join(text.split()),)
    return exc


@contextmanager
def speaks_plugin() -> Iterator[None]:
    """Errors raised inside leave in the plugin's words (``user_words``)."""
    try:
        yield
    except _WORDED as exc:
        raise user_words(exc) from None


@contextmanager
def keep_root_logger() -> Iterator[None]:
    """The root logger's handlers and level afterwards as they were before (opacus' import
    adds a handler: module docstring)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


@contextmanager
def boundary() -> Iterator[None]:
    """A plugin entry point: errors in the plugin's words, the root logger kept."""
    with keep_root_logger(), speaks_plugin():
        yield


def threads_setting(keywords: Mapping[str, Any], *configs: Mapping[str, Any]) -> int | None:
    """``privfedcal.threads`` (``threads=``) of a party, the last source winning; None where
    unset or not a valid count (``resolve`` refuses that with its own message)."""
    value = keywords.get("threads")
    for config in configs:
        value = config.get(PREFIX + "threads", value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``threads`` inside (None: as they are), restored after:
    the user's own training keeps the app's setting."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(before)
