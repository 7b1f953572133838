"""Name -> class registries; an unknown name lists the valid ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from privfedcal.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """A registry of components found by name (``create_algorithm("fedprox")``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._items:
            valid = ", ".join(sorted(self._items))
            raise UsageError(f"unknown {self.kind} {name!r}; valid choices: {valid}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
