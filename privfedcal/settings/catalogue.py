"""The one description of every setting a run takes.

A setting is declared once, as a field of one of ``RunConfig``'s sections
(privfedcal/settings/sections.py) or of ``RunConfig`` itself (or of :class:`FlowerOptions`)
made by :func:`setting` (``privfedcal/settings/descriptions.py``, below the config), as a
field of a method's ``Params`` made by ``algorithms.algorithm.hyper`` (the flags of
``METHOD_SETTINGS`` are derived from every registered method's), or as a field of a
calibrator's ``Params`` made by ``descriptions.calibration_option`` (``CALIBRATION_SETTINGS``,
likewise). Its name, type, default, help text, help group and flag spelling live there, and
everything else is derived from :func:`all_settings`:

- ``privfedcal train`` / ``privfedcal partition`` options (``cli/train_command.py`` builds the
  command's signature from them);
- settings files: TOML keys and types (:func:`check_value`, ``run_config.load_toml``);
- the Flower run config (:func:`flower_key`, :func:`flower_defaults`; ``flower/records.py``
  and ``examples/flower/pyproject.toml``, whose values a test compares);
- the tables of docs/usage.md and docs/flower.md (``python -m privfedcal.settings.catalogue --write``
  rewrites them, ``--check`` fails when they differ; a test runs the check).

Adding a setting: one ``setting(...)`` field on the section it belongs to (or a ``hyper`` /
``calibration_option`` field of a method's / calibrator's ``Params``), then ``python -m
privfedcal.settings.catalogue --write`` and the new key with its default in
``examples/flower/pyproject.toml`` (``tests/flower/test_example.py`` names what is missing).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Mapping
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
from privfedcal.settings.messages import SettingError, SettingText, declare_spelling
from privfedcal.settings.run_config import RunConfig


def _method_params() -> list[tuple[str, Any, type]]:
    """(method, Params field, base type) of every registered method's hyperparameters."""
    from privfedcal.algorithms import ALGORITHMS

    out = []
    for method in ALGORITHMS.names():
        params = ALGORITHMS.get(method).Params
        hints = typing.get_type_hints(params)
        out += [(method, f, field_kind(hints[f.name])[0]) for f in dataclasses.fields(params)]
    return out


def namespaced_name(method: str, param: str) -> str:
    """The setting of ``param`` of ``method`` alone: ``fedprox_mu`` (flag ``--fedprox-mu``)."""
    return f"{method.replace('-', '_')}_{param}"


def method_settings() -> tuple[Setting, ...]:
    """The hyperparameter flags of the registered methods (``[method_params]`` in a settings
    file), typed and described by the methods' ``Params`` fields: one per method and name
    (``--fedprox-mu``, ``--moon-mu``), and one per name (``--mu``) that sets it for whichever
    method runs, whose help lists each method's meaning. None means the method's default; a
    method refuses a hyperparameter it does not have."""
    uses: dict[str, list[tuple[str, Any, type]]] = {}
    own = []
    for method, f, kind in _method_params():
        uses.setdefault(f.name, []).append((method, f, kind))
        own.append(_hyper(namespaced_name(method, f.name), kind,
                          f"{method}: {f.metadata.get('help', f.name)} (the method's default "
                          "if unset).", scope="method"))
    shared = []
    for name, fields in uses.items():
        kinds = {kind for _, _, kind in fields}
        if len(kinds) != 1:
            raise TypeError(f"hyperparameter {name!r} has different types in "
                            f"{', '.join(m for m, *_ in fields)}: one flag needs one type")
        text = "; ".join(f"{m}: {f.metadata.get('help', name)}" for m, f, _ in fields)
        shared.append(_hyper(name, kinds.pop(), text + " (the method's default if unset).",
                             scope="method"))
    return tuple(shared + own)


def method_owners() -> dict[str, tuple[str, str]]:
    """Each namespaced hyperparameter setting -> (its method, the ``Params`` field)."""
    return {namespaced_name(m, f.name): (m, f.name) for m, f, _ in _method_params()}


METHOD_SETTINGS: tuple[Setting, ...] = method_settings()
#: the namespaced hyperparameter settings (``fedprox_mu``) -> (method, hyperparameter)
METHOD_OWNERS: dict[str, tuple[str, str]] = method_owners()
#: one ``--flag`` per ``calibration_option`` field of the registered calibrators' ``Params``
#: (``descriptions.register_calibration_options``), in calibrator-name and field order
CALIBRATION_SETTINGS: tuple[Setting, ...] = calibration_settings()


def place_hyperparameters(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (settings by name: flags, a settings file, API keywords) with each method
    hyperparameter or calibrator option named on its own moved into its table, over the
    table's value: ``mu`` and ``fedprox_mu`` into ``method_params["mu"]``,
    ``virtual_per_class`` into ``calibration_params``. A namespaced name must be one of the
    run's method (``--fedprox-mu`` with ``--method fedprox``). A table that is no mapping
    is left for ``RunConfig.from_dict`` to refuse."""
    from privfedcal.settings.run_config import METHOD_ALIASES

    out = dict(flat)
    method = str(out.get("method", RunConfig.method))
    method = METHOD_ALIASES.get(method, (method, ""))[0]
    for key, table in (("method_params", METHOD_SETTINGS),
                       ("calibration_params", CALIBRATION_SETTINGS)):
        named = [s for s in table if s.name in out]
        if not named or not isinstance(out.get(key, {}), Mapping):
            continue
        params, given = dict(out.get(key) or {}), {s.name for s in named}
        for s in named:
            value = out.pop(s.name)
            owner, name = METHOD_OWNERS.get(s.name, (None, s.name))
            if owner is not None and owner != method:
                raise SettingError("{given} is a hyperparameter of {method=}, not of {run}",
                                   given=SettingText.named([s.name]), method=owner, run=method)
            if owner is not None and name in given:
                raise SettingError("{given} and {shared} set the same hyperparameter: give one",
                                   given=SettingText.named([s.name]),
                                   shared=SettingText.named([name]))
            params[name] = value
        out[key] = params
    return out


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
    dotted keys; a method's hyperparameter is ``method-params.<name>``, never namespaced)."""
    return tuple(s for s in all_settings() if s.type is not dict and s.name not in METHOD_OWNERS)


def flower_defaults() -> dict[str, Any]:
    """Every Flower run-config key with its default: what the example app declares."""
    return {flower_key(s): flower_value(s, s.default) for s in flower_settings()}


# ---- docs tables -------------------------------------------------------------------------
def _toml_key(s: Setting) -> str:
    if s.name in METHOD_OWNERS:
        method, name = METHOD_OWNERS[s.name]
        return f"`method_params.{name}` (method {method})"
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
        flower = ("(dotted keys below)" if s.type is dict else "-" if s.name in METHOD_OWNERS
                  else f"`{flower_key(s)}`")
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


for _declared in all_settings():  # how messages spell each (settings/messages.py)
    declare_spelling(_declared.name, _declared.type,
                     _declared.param_decls[0] if _declared.param_decls else None,
                     flower=(f"{FLOWER_PREFIX['method']}{METHOD_OWNERS[_declared.name][1]}"
                             if _declared.name in METHOD_OWNERS else flower_key(_declared)
                             ).replace("_", "-"))

__all__ = ["CALIBRATION_SETTINGS", "GROUPS", "METHOD_OWNERS", "METHOD_SETTINGS", "PER_MODEL",
           "SCOPES", "place_hyperparameters",
           "FlowerOptions", "Setting", "all_settings", "check_value", "cli_settings",
           "flower_defaults", "flower_key", "flower_settings", "flower_value", "render",
           "setting", "settings_of", "stale_docs", "usage_table"]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))

