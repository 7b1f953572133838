"""Every module imports under the declared dependencies, and every third-party import is
declared: a fresh ``pip install -e .`` must give a working ``privfedcal``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

import privfedcal

ROOT = Path(privfedcal.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="privfedcal."))


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower().replace("_", "-")
            for r in reqs}


def _third_party_imports(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return {t for t in tops
            if t not in sys.stdlib_module_names and t not in ("privfedcal", "__future__")}


def test_every_third_party_import_is_a_declared_dependency():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    base = _requirement_names(project["dependencies"])
    flower = base | _requirement_names(project["optional-dependencies"]["flower"])
    dists = {k: {d.lower().replace("_", "-") for d in v}
             for k, v in packages_distributions().items()}
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        declared = flower if "flower" in path.relative_to(ROOT).parts else base
        for top in _third_party_imports(path):
            owners = dists.get(top, {top})
            if not owners & declared:
                missing.append(f"{top} ({path.relative_to(ROOT.parent)})")
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_check_above_sees_an_undeclared_import(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("import numpy\nfrom yaml import safe_load\nimport json\n"
                   "from privfedcal import config\n")
    assert _third_party_imports(mod) == {"numpy", "yaml"}


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name):
    """Outside ``privfedcal.flower`` every module imports with the base install; the Flower
    modules either import (extra installed) or name the extra to install."""
    if name.startswith("privfedcal.flower") and importlib.util.find_spec("flwr") is None:
        with pytest.raises(ModuleNotFoundError, match=r"privfedcal\[flower\]"):
            importlib.import_module(name)
        return
    importlib.import_module(name)
