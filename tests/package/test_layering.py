"""The package's layers import downwards only (docs/architecture.md).

Layer of each part of ``privfedcal`` (a package counts as one part, unless the table names
one of its modules or subpackages apart): foundations (errors, registry, seeding, tensors,
results, settings, privacy.cohorts, report.style) < data, models < algorithms, privacy <
federation < calibration, attacks, analysis, experiment, settings.catalogue (the catalogue
reads the calibrators' options) < report < flower, api, jobs < cli. A module may import its
own layer and the layers below; nothing outside ``privfedcal.cli`` imports the CLI but
``privfedcal.__main__`` (``python -m privfedcal``, the command's other entry). One exception:
the package's ``__init__`` re-exports the public API, so it may import ``privfedcal.api`` and
``privfedcal.jobs`` (lazily, on first use: ``import privfedcal`` stays cheap). Every import
statement counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import privfedcal

LAYERS: dict[str, int] = {
    "": 0, "errors": 0, "registry": 0, "seeding": 0, "tensors": 0, "results": 0,
    "settings": 0, "privacy.cohorts": 0, "report.style": 0,
    "data": 1, "models": 1,
    "algorithms": 2, "privacy": 2,
    "federation": 3,
    "calibration": 4, "attacks": 4, "analysis": 4, "experiment": 4,
    "settings.catalogue": 4,
    "report": 5,
    "flower": 6, "api": 6, "jobs": 6,
    "cli": 7, "__main__": 7,
}


def _part(module: str, layers: dict[str, int] | None = None) -> str:
    """The part of a dotted ``privfedcal.*`` name that the layer table places ('' for the
    package itself): the longest dotted prefix below ``privfedcal`` with an entry of its own
    (``settings.catalogue`` sits above the rest of ``settings``), else the top-level part."""
    parts = module.split(".")[1:]
    table = LAYERS if layers is None else layers
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in table:
            return ".".join(parts[:n])
    return parts[0] if parts else ""


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every ``privfedcal`` module the file's statements import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "privfedcal":  # from privfedcal import experiment
                found += [(node.lineno, f"privfedcal.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, name))
    return [(line, n) for line, n in found if n == "privfedcal" or n.startswith("privfedcal.")]


def violations(root: Path, layers: dict[str, int] = LAYERS) -> list[str]:
    """Every import in the package at ``root`` that goes up a layer or reaches the CLI, as
    ``file:line: importer (layer) -> imported (layer)``; a module missing from ``layers``
    is reported too, so that a new one is placed on purpose."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        own = _part(module, layers)
        if own not in layers:
            out.append(f"{rel}.py: module {own!r} has no layer")
            continue
        for line, name in _imported(ast.parse(path.read_text()), module, is_package):
            target = _part(name, layers)
            if target == own or (rel.as_posix() == "privfedcal/__init__"
                                 and target in ("api", "jobs")):
                continue
            if target not in layers:
                level = "no layer"
            elif target == "cli" and own != "__main__" or layers[target] > layers[own]:
                level = str(layers[target])
            else:
                continue
            out.append(f"{rel}.py:{line}: {own} ({layers[own]}) -> {name} ({level})")
    return out


def test_layers_import_downwards_only():
    found = violations(Path(privfedcal.__file__).parent)
    assert found == [], "imports against the layers:\n" + "\n".join(found)



@pytest.mark.parametrize(("files", "expected"), [
    ({"privacy/__init__.py": "", "privacy/x.py": "from privfedcal.federation.hooks import A\n"},
     ["privfedcal/privacy/x.py:1: privacy (2) -> privfedcal.federation.hooks (3)"]),
    ({"attacks/__init__.py": "", "attacks/a.py": "def f():\n    import privfedcal.cli.run_progress\n"},
     ["privfedcal/attacks/a.py:2: attacks (4) -> privfedcal.cli.run_progress (7)"]),
    ({"flower/__init__.py": "from privfedcal import cli\n"},
     ["privfedcal/flower/__init__.py:1: flower (6) -> privfedcal.cli (7)"]),
    ({"data/__init__.py": "", "data/d.py": "from ..models import m\n"}, []),
    ({"models/m.py": "from ..federation import simulator\n"},
     ["privfedcal/models/m.py:1: models (1) -> privfedcal.federation (3)"]),
    ({"newpart.py": ""}, ["privfedcal/newpart.py: module 'newpart' has no layer"]),
    ({"api.py": "from privfedcal.cli import run\n"},
     ["privfedcal/api.py:1: api (6) -> privfedcal.cli (7)"]),
    ({"__init__.py": "from privfedcal import api\n"}, []),  # the facade's one exception
    ({"seeding.py": "from privfedcal import api\n"},
     ["privfedcal/seeding.py:1: seeding (0) -> privfedcal.api (6)"]),
    ({"settings/__init__.py": "", "settings/c.py": "from privfedcal.settings.catalogue import S\n",
      "settings/catalogue.py": ""},
     ["privfedcal/settings/c.py:1: settings (0) -> privfedcal.settings.catalogue (4)"]),
    ({"cli/main.py": "from privfedcal.flower import server_app\nimport privfedcal.errors\n"}, []),
    ({"__main__.py": "from privfedcal.cli.main import main\n"}, []),
])
def test_a_planted_violation_is_caught(plant, files, expected):
    assert violations(plant(files)) == expected


# ---- no module imports one that imports it back --------------------------------------------
def _module_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the ``privfedcal`` modules its import statements name (a ``from pkg import
    name`` counts as the submodule ``pkg.name`` when there is one, else as ``pkg``); a
    module's own package ``__init__`` is not counted (Python runs it first anyway)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                names = [f"{name}.{a.name}" if f"{name}.{a.name}" in modules else name
                         for a in node.names]
            targets |= {n for n in names if n in modules}
        graph[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return graph


def cycles(root: Path) -> list[list[str]]:
    """The import cycles among the modules under ``root``: each strongly connected set of
    two or more modules (Tarjan's algorithm), sorted."""
    graph = _module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles():
    found = cycles(Path(privfedcal.__file__).parent)
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(("files", "expected"), [
    # the five-module cycle privacy/ once had, in miniature: a lazy import closes it
    ({"privacy/__init__.py": "", "privacy/a.py": "from privfedcal.privacy import b\n",
      "privacy/b.py": "from privfedcal.privacy.c import X\n",
      "privacy/c.py": "def f():\n    from privfedcal.privacy.a import Y\n"},
     [["privfedcal.privacy.a", "privfedcal.privacy.b", "privfedcal.privacy.c"]]),
    # a type-only import is an import too
    ({"config.py": "from privfedcal.catalogue import S\n",
      "catalogue.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from privfedcal.config import C\n"},
     [["privfedcal.catalogue", "privfedcal.config"]]),
    # relative imports resolve; importing one's own package is not a cycle
    ({"fed/__init__.py": "from .x import A\n", "fed/x.py": "from . import y\n",
      "fed/y.py": "import privfedcal.fed\n"}, []),
])
def test_a_planted_cycle_is_caught(plant, files, expected):
    assert cycles(plant(files)) == expected
