"""Components found by name, declared in one explicit table per kind (Opacus' idiom).

A kind of component the tool finds by name (methods, calibrators, models, datasets, Flower
payload tasks) has one ``Registry``. Its built-ins are
written out in the ``built_in`` mapping where the registry is created, so a reader sees every
name in one place; extensions add theirs from their own file with ``register``::

    ALGORITHMS = Registry("method", built_in={
        "fedavg": "privfedcal.algorithms.fedavg:FedAvg",   # imported on first lookup
        ...
    })

    @ALGORITHMS.register("my-method")                     # an extension, in its own file
    class MyMethod(Algorithm): ...

API (stable):

* ``Registry(kind, built_in=None)``: ``kind`` names the component in messages ("method");
  ``built_in`` maps each built-in name to the object itself or to its import path
  ``"package.module:attribute"``, imported on the name's first lookup, so that creating the
  registry imports nothing (``import privfedcal`` stays cheap, and a table may name modules
  that import the registry's own module).
* ``register(name)``: a decorator adding an extension; a name already taken by another
  component (built-in or not) raises ``UsageError``, and registering the same component
  under its name again does nothing (a module imported twice).
* ``unregister(name)``: takes an extension out again and returns it; a built-in cannot be
  taken out, and an unknown name raises ``UsageError``.
* ``get(name)``: the component; an unknown name raises ``UsageError`` listing the valid ones.
* ``names()``: every name, the built-ins in their declared order then the extensions in
  the order they were registered; ``name in registry`` tests one without importing it.
* ``items()``: ``(name, component)`` pairs in the order of ``names()`` (imports them all).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from privfedcal.errors import UsageError

T = TypeVar("T")


def _load(path: str) -> Any:
    """The attribute ``path`` ("package.module:attribute") names, its module imported."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Registry(Generic[T]):
    """The components of one kind, by name: an explicit table of built-ins plus extensions."""

    def __init__(self, kind: str, built_in: Mapping[str, str | T] | None = None) -> None:
        self.kind = kind
        self._built_in: dict[str, str | T] = dict(built_in or {})
        self._loaded: dict[str, T] = {}
        self._extensions: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that adds ``obj`` under ``name`` (an extension's own file calls it)."""

        def deco(obj: T) -> T:
            if name in self:
                if self.get(name) is obj:
                    return obj
                raise UsageError(f"{self.kind} {name!r} registered twice")
            self._extensions[name] = obj
            return obj

        return deco

    def unregister(self, name: str) -> T:
        """Take the extension ``name`` out again (tests undo what a toy registered)."""
        if name in self._built_in:
            raise UsageError(f"{self.kind} {name!r} is built in and cannot be unregistered")
        if name not in self._extensions:
            self.get(name)  # raises, listing the valid names
        return self._extensions.pop(name)

    def get(self, name: str) -> T:
        """The component registered as ``name``; an unknown name lists the valid ones."""
        if name in self._extensions:
            return self._extensions[name]
        if name not in self._built_in:
            raise UsageError(f"unknown {self.kind} {name!r}; valid choices: "
                             f"{', '.join(self.names())}")
        if name not in self._loaded:
            entry = self._built_in[name]
            self._loaded[name] = _load(entry) if isinstance(entry, str) else entry
        return self._loaded[name]

    def names(self) -> list[str]:
        """The built-ins in declared order, then the extensions in registration order."""
        return [*self._built_in, *self._extensions]

    def items(self) -> list[tuple[str, T]]:
        """``(name, component)`` for every name, in the order of ``names()``."""
        return [(name, self.get(name)) for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._built_in or name in self._extensions

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._built_in) + len(self._extensions)
