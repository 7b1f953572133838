"""The README's test command installs only the dev extra: every test module that needs an
optional extra (flwr) must skip itself before importing it, or collection fails for a newcomer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
OPTIONAL = ("flwr",)


def _first_optional_import(tree: ast.Module) -> int | None:
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n.split(".")[0] in OPTIONAL for n in names):
            return node.lineno
    return None


def _first_skip(tree: ast.Module) -> int | None:
    for node in tree.body:
        src = ast.unparse(node)
        if "importorskip" in src and any(f'"{m}"' in src or f"'{m}'" in src for m in OPTIONAL):
            return node.lineno
    return None


@pytest.mark.parametrize(
    "path", sorted(TESTS.rglob("test_*.py")), ids=lambda p: str(p.relative_to(TESTS))
)
def test_optional_imports_come_after_a_skip(path):
    tree = ast.parse(path.read_text())
    first = _first_optional_import(tree)
    if first is None:
        return
    skip = _first_skip(tree)
    assert skip is not None and skip < first, (
        f"{path.name} imports an optional extra at line {first} before pytest.importorskip"
    )
