"""The package's top level is its face, not a hallway: at most 8 modules beside its
sub-packages (``__init__``, ``__main__``, ``errors``, ...); a new concern goes into the
sub-package that names it (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

import privfedcal

ROOT = Path(privfedcal.__file__).parent
MOST = 8


def test_the_top_level_holds_few_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= MOST, f"{len(modules)} top-level modules (at most {MOST}): {modules}"
    assert "__init__.py" in modules  # the check sees the package
