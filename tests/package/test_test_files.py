"""Every module of federation/ and attacks/ has a test file of its own beside it
(tests/<area>/<subpackage>/test_<module>.py), and no two test files share a basename (pytest imports them
by basename: a second one stops collection)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import privfedcal

ROOT = Path(privfedcal.__file__).resolve().parent
TESTS = Path(__file__).resolve().parents[1]
AREAS = ("federation", "attacks")


def test_every_module_has_its_own_test_file():
    missing = [(Path("tests") / area / where / f"test_{m.stem}.py").as_posix() for area in AREAS
               for m in sorted((ROOT / area).rglob("*.py"))
               if m.stem != "__init__"
               and not (TESTS / area / (where := m.parent.relative_to(ROOT / area))
                        / f"test_{m.stem}.py").is_file()]
    assert not missing, f"modules without a test file: {missing}"
    # the check sees the package: it would report a module added without tests
    assert (ROOT / "federation" / "simulator.py").is_file()
    assert (ROOT / "attacks" / "distinguishing" / "games.py").is_file()


def test_test_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1]
