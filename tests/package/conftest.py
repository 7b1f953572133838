"""Fixtures of the package's structure tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def plant(tmp_path: Path) -> Callable[[dict[str, str]], Path]:
    """A function writing a miniature ``privfedcal`` package of the given files (relative
    path -> source, an empty ``__init__.py`` added) under the test's folder; it returns the
    package's folder, for checks that read a package's source."""

    def write(files: dict[str, str]) -> Path:
        pkg = tmp_path / "privfedcal"
        for name, text in {"__init__.py": "", **files}.items():
            path = pkg / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return pkg

    return write
