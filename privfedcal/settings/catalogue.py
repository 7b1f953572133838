"""The one description of every setting a run takes.

A setting is declared once, as a field of :class:`privfedcal.settings.run_config.RunConfig` (or of
:class:`FlowerOptions`) made by :func:`setting` (``privfedcal/settings/descriptions.py``, below the
config), as a field of a method's ``Params`` made by ``algorithms.algorithm.hyper`` (the flags of
``METHOD_SETTINGS`` are derived from every registered method's), or as a field of a
calibrator's ``Params`` made by ``descriptions.calibration_option`` (``CALIBRATION_SETTINGS``,
likewise). Its name, type, default,
help text, help group and flag spelling live there, and everything else is derived from
:func:`all_settings`:

- ``privfedcal train`` / ``privfedcal partition`` options (``cli/train_command.py`` builds the
  command's signature from them);
- settings files: TOML keys and types (:func:`check_value`, ``config.load_toml``);
- the Flower run config (:func:`flower_key`, :func:`flower_defaults`; ``flower/records.py``
  and ``examples/flower/pyproject.toml``, whose values a test compares);
- the tables of docs/usage.md and docs/flower.md (``python -m privfedcal.settings.catalogue --write``
  rewrites them, ``--check`` fails when they differ; a test runs the check).

Adding a setting: one ``setting(...)`` field on ``RunConfig`` (or a ``hyper`` /
``calibration_option`` field of a method's / calibrator's ``Params``), then ``python -m
privfedcal.settings.catalogue --write`` and the new key with its default in
``examples/flower/pyproject.toml`` (``tests/flower/test_example.py`` names what is missing).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import privfedcal.calibration  # noqa: F401  (each calibrator registers its options)
from privfedcal.settings.descriptions import (
    GROUPS,
    PER_MODEL,
    SCOPES,
    FlowerOptions,
    Setting,
    _hyper,
    calibration_settings,
    check_value,
    field_kind,
    render,
    setting,
    settings_of,
)
from privfedcal.settings.run_config import RunConfig


def method_settings() -> tuple[Setting, ...]:
    """One ``--flag`` per hyperparameter name of the registered methods (``[method_params]``
    in a settings file), typed and described by the methods' ``Params`` fields; a name
    several methods share (``mu``) is one flag whose help lists each method's meaning. None
    means the method's default; a method refuses a hyperparameter it does not have."""
    from privfedcal.algorithms import ALGORITHMS

    uses: dict[str, list[tuple[str, Any, type, bool]]] = {}
    for method in ALGORITHMS.names():
        params = ALGORITHMS.get(method).Params
        hints = typing.get_type_hints(params)
        for f in dataclasses.fields(params):
            kind, optional = field_kind(hints[f.name])
            uses.setdefault(f.name, []).append((method, f, kind, optional))
    out = []
    for name, fields in uses.items():
        kinds = {kind for _, _, kind, _ in fields}
        if len(kinds) != 1:
            raise TypeError(f"hyperparameter {name!r} has different types in "
                            f"{', '.join(m for m, *_ in fields)}: one flag needs one type")
        text = "; ".join(f"{m}: {f.metadata.get('help', name)}" for m, f, _, _ in fields)
        out.append(_hyper(name, kinds.pop(), text + " (the method's default if unset).",
                          scope="method"))
    return tuple(out)


METHOD_SETTINGS: tuple[Setting, ...] = method_settings()
#: one ``--flag`` per ``calibration_option`` field of the registered calibrators' ``Params``
#: (``descriptions.register_calibration_options``), in calibrator-name and field order
CALIBRATION_SETTINGS: tuple[Setting, ...] = calibration_settings()


def all_settings() -> tuple[Setting, ...]:
    """Every setting: RunConfig's fields, the hyperparameter flags, the Flower options."""
    return (settings_of(RunConfig, "run") + METHOD_SETTINGS + CALIBRATION_SETTINGS
            + settings_of(FlowerOptions, "flower"))


def cli_settings() -> tuple[Setting, ...]:
    """The settings ``privfedcal train`` has a flag for, grouped as ``--help`` shows them."""
    chosen = [s for s in all_settings() if s.cli]
    return tuple(sorted(chosen, key=lambda s: GROUPS.index(s.group)))


FLOWER_PREFIX = {"method": "method-params.", "calibration": "calibration-params.",
                 "flower": "flower."}


def flower_key(s: Setting) -> str:
    """The setting's key in Flower's flat run config (``local-epochs``, ``method-params.mu``,
    ``flower.round-timeout``)."""
    return FLOWER_PREFIX.get(s.scope, "") + s.name.replace("_", "-")


def flower_value(s: Setting, value: Any) -> Any:
    """``value`` as the run config writes it: TOML has no null, so None is ``""``."""
    return "" if value is None else value


def flower_settings() -> tuple[Setting, ...]:
    """The settings that are keys of the Flower run config (the tables are split into
    dotted keys)."""
    return tuple(s for s in all_settings() if s.type is not dict)


def flower_defaults() -> dict[str, Any]:
    """Every Flower run-config key with its default: what the example app declares."""
    return {flower_key(s): flower_value(s, s.default) for s in flower_settings()}


# ---- docs tables -------------------------------------------------------------------------
def _toml_key(s: Setting) -> str:
    if s.scope == "method":
        return f"`method_params.{s.name}`"
    if s.scope == "calibration":
        return f"`calibration_params.{s.name}`"
    if s.type is dict:
        return f"`[{s.name}]`"
    return f"`{s.name}`"


def _cell(text: str) -> str:
    """``text`` safe in a markdown table cell (``|`` splits cells, ``<x>`` is HTML)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def usage_table() -> str:
    """docs/usage.md's table of every ``train`` setting (Flower options excluded)."""
    rows = ["| group | flag | settings file | Flower run config | default | meaning |",
            "| --- | --- | --- | --- | --- | --- |"]
    ordered = sorted((s for s in all_settings() if s.scope != "flower"),
                     key=lambda s: GROUPS.index(s.group))
    for s in ordered:
        flag = f"`{s.param_decls[0] if s.param_decls else s.flag_name}`" if s.cli else "-"
        flower = "(dotted keys below)" if s.type is dict else f"`{flower_key(s)}`"
        rows.append(f"| {s.group} | {_cell(flag)} | {_toml_key(s)} | {flower} | "
                    f"{_cell(s.shown_default) or '-'} | {_cell(s.help)} |")
    return "\n".join(rows)


def flower_table() -> str:
    """docs/flower.md's table of the ``flower.*`` keys."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for s in all_settings():
        if s.scope == "flower":
            rows.append(f"| `{flower_key(s)}` | {s.shown_default} | {_cell(s.help)} |")
    return "\n".join(rows)


#: (file, marker name, generator) of every generated docs table
DOC_TABLES = (("docs/usage.md", "settings", usage_table),
              ("docs/flower.md", "flower-options", flower_table))


def rewrite(text: str, marker: str, table: str) -> str:
    """``text`` with the block between ``<!-- marker:begin -->`` and ``<!-- marker:end -->``
    replaced by ``table``."""
    begin, end = f"<!-- {marker}:begin (generated: python -m privfedcal.settings.catalogue --write) -->", \
        f"<!-- {marker}:end -->"
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"markers {begin} ... {end} not found")
    return f"{head}{begin}\n{table}\n{end}{tail}"


def stale_docs(root: Path) -> list[str]:
    """The docs files whose generated tables differ from the description."""
    return [name for name, marker, make in DOC_TABLES
            if (text := (root / name).read_text()) != rewrite(text, marker, make())]


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    if argv == ["--write"]:
        for name, marker, make in DOC_TABLES:
            path = root / name
            path.write_text(rewrite(path.read_text(), marker, make()))
        return 0
    if argv == ["--check"]:
        stale = stale_docs(root)
        for name in stale:
            print(f"{name}: settings table out of date; run python -m privfedcal.settings.catalogue "
                  "--write", file=sys.stderr)
        return 1 if stale else 0
    print("usage: python -m privfedcal.settings.catalogue --write | --check", file=sys.stderr)
    return 2


__all__ = ["CALIBRATION_SETTINGS", "GROUPS", "METHOD_SETTINGS", "PER_MODEL", "SCOPES",
           "FlowerOptions", "Setting", "all_settings", "check_value", "cli_settings",
           "flower_defaults", "flower_key", "flower_settings", "flower_value", "render",
           "setting", "settings_of", "stale_docs", "usage_table"]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))

