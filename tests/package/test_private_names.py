"""A package's private names stay inside it: no module imports an underscore name
(``_coerce``, not a dunder) from a module of another top-level part of ``privfedcal``, by
``from privfedcal.x import _y`` or by reading ``x._y`` off a module it imported. Within one
part (``api/run.py`` from ``api/arguments.py``) it is allowed: that is what a package's
private parts are for. A top-level module (``experiment.py``) is a part of its own, and so
is the package's ``__init__``. Every import statement counts, lazy ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import privfedcal


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted name, is a package's ``__init__``) of the file at ``path``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _part(module: str) -> str:
    """The top-level part of ``privfedcal`` that ``module`` belongs to ('' for the package's
    own ``__init__``)."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _bound_modules(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Each local name the file binds to a ``privfedcal`` module (``import privfedcal.jobs
    as jobs``, ``from privfedcal import jobs``, ``from privfedcal.flower.plugin import
    server_calibration as sc``): name -> dotted module."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("privfedcal") and a.asname:
                    bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            if source.startswith("privfedcal"):
                for a in node.names:
                    if not _private(a.name):
                        bound[a.asname or a.name] = f"{source}.{a.name}"
    return bound


def _crossings(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, ``source._name``) of every private name the file takes from another part."""
    own = _part(module)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            if source.startswith("privfedcal"):
                found += [(node.lineno, f"{source}.{a.name}") for a in node.names
                          if _private(a.name)]
    bound = _bound_modules(tree, module, is_package)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            head = base.split(".")[0]
            if head in bound:
                source = bound[head] + base[len(head):]
                found.append((node.lineno, f"{source}.{node.attr}"))
            elif base.startswith("privfedcal."):  # import privfedcal.x.y; privfedcal.x.y._z
                found.append((node.lineno, f"{base}.{node.attr}"))
    return [(line, name) for line, name in found if _part(name.rsplit(".", 1)[0]) != own]


def private_crossings(root: Path) -> list[str]:
    """Every private name taken across parts in the package at ``root``, as
    ``file:line: importer -> source._name``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module, is_package = _module_of(path, root)
        rel = path.relative_to(root.parent).as_posix()
        for line, name in _crossings(ast.parse(path.read_text()), module, is_package):
            out.append(f"{rel}:{line}: {module} -> {name}")
    return out


def test_no_private_name_crosses_a_package():
    found = private_crossings(Path(privfedcal.__file__).parent)
    assert found == [], "private names taken from another package:\n" + "\n".join(found)



@pytest.mark.parametrize(("files", "expected"), [
    ({"cli/__init__.py": "", "cli/c.py": "def f():\n    from privfedcal.api import _resume\n"},
     ["privfedcal/cli/c.py:2: privfedcal.cli.c -> privfedcal.api._resume"]),
    ({"cli/c.py": "from privfedcal import jobs\njobs._audit()\n"},
     ["privfedcal/cli/c.py:2: privfedcal.cli.c -> privfedcal.jobs._audit"]),
    ({"jobs/j.py": "import privfedcal.api.arguments as a\nx = a._coerce\n"},
     ["privfedcal/jobs/j.py:2: privfedcal.jobs.j -> privfedcal.api.arguments._coerce"]),
    ({"jobs/j.py": "import privfedcal.api.arguments\nx = privfedcal.api.arguments._coerce\n"},
     ["privfedcal/jobs/j.py:2: privfedcal.jobs.j -> privfedcal.api.arguments._coerce"]),
    ({"experiment.py": "from privfedcal.settings.descriptions import _kind\n"},
     ["privfedcal/experiment.py:1: privfedcal.experiment -> privfedcal.settings.descriptions._kind"]),
    ({"api/__init__.py": "", "api/b.py": "from ..settings import _kind\n"},
     ["privfedcal/api/b.py:1: privfedcal.api.b -> privfedcal.settings._kind"]),
    # allowed: within one package, at any depth; dunders; public names
    ({"api/__init__.py": "from privfedcal.api.run import _check\n", "api/run.py": ""}, []),
    ({"flower/p/a.py": "from privfedcal.flower.plugin import server as sc\nsc._hello()\n"}, []),
    ({"cli/c.py": "from privfedcal import jobs\njobs.__doc__\njobs.audit_for_cli()\n"}, []),
    ({"cli/c.py": "import os\nos._exit(0)\n"}, []),  # not privfedcal's
])
def test_a_planted_crossing_is_caught(plant, files, expected):
    assert private_crossings(plant(files)) == expected
