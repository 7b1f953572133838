"""Every exception class the package defines is a ``PrivfedcalError`` (one root, as
pfl-research's ``PFLError``), and keeps the built-in base its callers catch."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import privfedcal
from privfedcal.errors import (
    BudgetRefused,
    Diverged,
    Interrupted,
    PrivacyBudgetError,
    PrivfedcalError,
    ReleaseSkipped,
    UploadRejected,
    UsageError,
)

#: run as programs, not imported (``python -m privfedcal`` starts the CLI)
NOT_IMPORTED = {"privfedcal.__main__"}
#: interrupts, not errors: a ``KeyboardInterrupt`` must pass ``except Exception`` handlers,
#: and ``PrivfedcalError`` is an ``Exception``
INTERRUPTS = (KeyboardInterrupt,)


def defined_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in a module of the package (nested ones included)."""
    found: dict[str, type[BaseException]] = {}
    flower = importlib.util.find_spec("flwr") is not None
    for info in pkgutil.walk_packages(privfedcal.__path__, "privfedcal."):
        if info.name in NOT_IMPORTED:
            continue
        if not flower and info.name.startswith("privfedcal.flower"):
            continue  # needs the flower extra; CI runs this test again with it installed
        module = importlib.import_module(info.name)
        stack = [obj for _, obj in inspect.getmembers(module, inspect.isclass)]
        while stack:
            cls = stack.pop()
            if cls.__module__ != info.name or f"{cls.__module__}.{cls.__qualname__}" in found:
                continue
            stack += [obj for _, obj in inspect.getmembers(cls, inspect.isclass)]
            if issubclass(cls, BaseException):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


def test_every_exception_of_the_package_is_a_privfedcal_error():
    classes = defined_exceptions()
    assert UsageError in classes and len(classes) >= 15  # the walk sees the package
    stray = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes
                   if not issubclass(c, PrivfedcalError) and not issubclass(c, INTERRUPTS))
    assert not stray, f"exception classes outside PrivfedcalError: {stray}"


@pytest.mark.parametrize("cls, base", [
    (UsageError, ValueError), (UploadRejected, ValueError),
    (PrivacyBudgetError, RuntimeError), (BudgetRefused, PrivacyBudgetError),
    (ReleaseSkipped, RuntimeError), (Diverged, RuntimeError), (Interrupted, Exception),
])
def test_the_built_in_bases_stay(cls: type[BaseException], base: type[BaseException]):
    assert issubclass(cls, PrivfedcalError) and issubclass(cls, base)
    assert not issubclass(PrivfedcalError, (ValueError, RuntimeError))
