"""A docstring, comment or doc that cites a file or a name cites one that exists.

Scanned: the docstrings and comments of ``privfedcal/**/*.py``, and ``README.md``,
``CONTRIBUTING.md`` and ``docs/**/*.md``. Cited are:

* paths ending in ``.py`` or ``.md``: resolved against the repository root, the
  package (``calibration/ccvr.py``), ``docs/`` and the citing file's folder; a path whose
  first folder is none of ours (``opacus/accountants/__init__.py``) cites another project
  and is skipped; a bare name (``ccvr.py``) must be the name of some file of the repository;
* dotted names ``privfedcal.a.b``, and ``a.b`` where ``a`` is one of the package's
  subpackages, written as code (between backticks): a module, or an attribute of one. Not
  Python's: a name followed by a hyphen (``privfedcal.dp-eps``), a Flower run-config key
  (``privfedcal.rounds``: a setting's name), and ``a.b`` where ``a`` also names a settings
  section or a part of ``summary.json`` (``flower.hold``, ``privacy.whole_run``).

A passage of a doc that names a commit (``the code at commit 8d8e21b``) may also cite that
commit's files and modules, up to the next heading or bold lead (``**After**``): a walk
through the code before a change stays checkable.
"""

from __future__ import annotations

import ast
import functools
import importlib
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

import privfedcal

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(privfedcal.__file__).resolve().parent
#: the repository's own top-level folders: a path starting elsewhere cites another project
OWN_TOPS = {"privfedcal", "tests", "benchmarks", "docs", "examples", "configs", ".ci"}
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
#: file names that other projects' files carry, cited as such (a file of theirs, not ours)
FOREIGN_FILES = {
    "privacy_engine.py",       # Opacus
    "simulate.py",             # pfl-research's pfl/aggregate/simulate.py
    "base.py",                 # pfl-research's pfl/algorithm/base.py
    "start_client_internal.py", "run_clientapp.py",  # Flower's
}
#: names of the package's that are no Python names: a node's state key, a logger
NOT_PYTHON = {"privfedcal.ledger", "privfedcal.flower.client"}
#: subpackages whose name is also a settings section or a ``summary.json`` key
KEY_SECTIONS = {"data", "flower", "privacy"}

_PATH = re.compile(r"(?<![\w./<>*{$-])((?:\.{1,2}/)*(?:[\w.-]+/)*[\w-]+\.(?:py|md))(?![\w/-])")
#: a name followed by a hyphen is a run-config key (``privfedcal.dp-eps``), not Python's
_DOTTED = re.compile(r"(?<![\w.])(privfedcal(?:\.[A-Za-z_]\w*)+)(?![\w-])")
_CODE = re.compile(r"`+([^`]+)`+")
_EXTENSIONS = {"py", "md", "toml", "json", "html", "png", "csv", "npz", "txt", "pt", "svg",
               "jsonl", "pdf", "yaml", "yml", "sh", "log", "pkl", "bin", "gz", "zip"}


def python_prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                for offset, line in enumerate(body[0].value.value.splitlines()):
                    yield body[0].lineno + offset, line


_COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})\b")


def markdown_prose(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(line, text, the commit the passage names or None) of every line of a doc."""
    commit = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith(("#", "**")):
            commit = None
        named = _COMMIT.search(line)
        commit = named.group(1) if named else commit
        yield number, line, commit


@functools.cache
def files_at(commit: str) -> frozenset[str]:
    """The paths of the repository's files at ``commit``."""
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return frozenset(listed.splitlines())


def existed_at(commit: str, cited: str, citing: Path) -> bool:
    """Whether ``cited`` (a path, or a dotted ``privfedcal.`` name) named something at
    ``commit``: a path resolved as ``path_exists`` does, a name by its module."""
    files = files_at(commit)
    if cited.startswith("privfedcal.") and "/" not in cited:
        parts = cited.split(".")
        return any(f"{'/'.join(parts[:cut])}{end}" in files for cut in range(2, len(parts) + 1)
                   for end in (".py", "/__init__.py"))
    if "/" not in cited:
        return any(Path(f).name == cited for f in files)
    here = citing.parent.relative_to(ROOT).as_posix() if citing.is_relative_to(ROOT) else ""
    return any(f"{base}{cited}" in files for base in ("", "privfedcal/", "docs/", f"{here}/"))


@functools.cache
def repository_basenames() -> frozenset[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return frozenset(Path(p).name for p in listed.splitlines())


def path_exists(cited: str, citing: Path) -> bool:
    """Whether ``cited`` names a file of the repository (or is another project's)."""
    if "/" not in cited:
        return cited in repository_basenames() or cited in FOREIGN_FILES
    bases = (ROOT, PACKAGE, ROOT / "docs", citing.parent)
    if any((base / cited).exists() for base in bases):
        return True
    first = cited.split("/")[0]
    return first not in OWN_TOPS and first not in SUBPACKAGES and first not in (".", "..")


@functools.cache
def setting_names() -> frozenset[str]:
    """The names of every setting (a Flower run config's ``privfedcal.<name>`` keys)."""
    from privfedcal.settings.catalogue import all_settings

    return frozenset(s.name for s in all_settings())


def _source_of(parts: list[str]) -> Path | None:
    """The file of the package's module ``parts`` names (``privfedcal.flower.grid``), if any."""
    base = Path(privfedcal.__file__).parent.parent.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _defined_in_source(module: list[str], rest: list[str]) -> bool:
    """Whether the module's source defines or imports ``rest[0]`` at its top level: how a
    citation into a module that needs an extra not installed here (the Flower modules in
    the base install) is checked without importing it; CI checks it again, imported, after
    installing the extra."""
    if not rest:
        return True
    tree = ast.parse(_source_of(module).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return rest[0] in names or _source_of([*module, rest[0]]) is not None


@functools.cache
def name_exists(dotted: str) -> bool:
    """Whether ``privfedcal.a.b...`` is a module of the package or an attribute of one."""
    parts = dotted.split(".")
    if dotted in NOT_PYTHON or (len(parts) == 2 and parts[1] in setting_names()):
        return True
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            if _source_of(parts[:cut]) is not None:  # there, but an extra is not installed
                return _defined_in_source(parts[:cut], parts[cut:])
            continue
        for attribute in parts[cut:]:
            try:
                obj = getattr(obj, attribute)
            except AttributeError:
                return (hasattr(obj, "__dataclass_fields__")
                        and attribute in obj.__dataclass_fields__)
        return True
    return False


def cited_names(text: str) -> Iterator[str]:
    """The dotted names of the package that ``text`` cites."""
    for match in _DOTTED.finditer(text):
        yield match.group(1).rstrip(".")
    for code in _CODE.findall(text):
        for word in re.findall(r"(?<![\w.-])([a-z_]+(?:\.[A-Za-z_]\w*)+)(?![\w-])", code):
            first = word.split(".")[0]
            if first not in SUBPACKAGES or word.rsplit(".", 1)[1] in _EXTENSIONS:
                continue
            if first not in KEY_SECTIONS:
                yield f"privfedcal.{word}"


def stale(files: list[Path]) -> list[str]:
    """``file:line: citation`` for every citation in ``files`` that names nothing."""
    out = []
    for path in files:
        lines = (((n, t, None) for n, t in python_prose(path)) if path.suffix == ".py"
                 else markdown_prose(path))
        for number, text, commit in lines:
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
            for cited in _PATH.findall(text):
                if not path_exists(cited, path) and not (
                        commit and existed_at(commit, cited, path)):
                    out.append(f"{where}: {cited}")
            for dotted in dict.fromkeys(cited_names(text)):
                if not name_exists(dotted) and not (commit and existed_at(commit, dotted, path)):
                    out.append(f"{where}: {dotted.removeprefix('privfedcal.')}")
    return out


def scanned() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [*sorted(PACKAGE.rglob("*.py")), ROOT / "README.md", ROOT / "CONTRIBUTING.md", *docs]


def test_every_citation_names_something_that_exists():
    found = stale(scanned())
    assert not found, "stale citations:\n" + "\n".join(found)


@pytest.mark.parametrize("citation", [
    "privfedcal/federation/nowhere.py", "calibration/release_fields.py", "tests/none/test_x.py",
    "config_gone.py", "``privfedcal.algorithms.base.hyper``", "``algorithms.base.hyper``",
])
def test_a_planted_stale_citation_fails(tmp_path: Path, citation: str):
    planted = tmp_path / "planted.py"
    planted.write_text(f'"""Module.\n\nSee {citation} for the rest."""\n\n# and {citation}\n')
    assert len(stale([planted])) == 2


def test_a_passage_naming_a_commit_may_cite_its_files(tmp_path: Path):
    doc = tmp_path / "walk.md"
    doc.write_text("**Before** (the code at commit 8d8e21b):\n`config.py:128`, "
                   "`settings.py`, `privfedcal.options`\n\n**After**: `config.py`\n")
    assert stale([doc]) == [f"{doc}:4: config.py"]


def test_existing_citations_pass(tmp_path: Path):
    planted = tmp_path / "fine.py"
    planted.write_text('"""See privfedcal/federation/hooks.py, calibration/ccvr.py, ccvr.py,\n'
                       "``privfedcal.errors.UsageError``, ``federation.hooks.CALIBRATORS``,\n"
                       'opacus/accountants/__init__.py and docs/usage.md."""\n')
    assert stale([planted]) == []
