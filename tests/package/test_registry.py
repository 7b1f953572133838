"""The one registry idiom: an explicit table of built-ins, imported on first lookup, plus
extensions registered from their own file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from privfedcal.errors import UsageError
from privfedcal.registry import Registry


def test_builtins_load_on_first_lookup_and_keep_their_declared_order():
    reg: Registry[object] = Registry("thing", built_in={
        "b-path": "collections:OrderedDict", "a-obj": dict})
    assert reg.names() == ["b-path", "a-obj"] and "b-path" in reg and len(reg) == 2
    import collections

    assert reg.get("b-path") is collections.OrderedDict and reg.get("a-obj") is dict
    assert reg.items() == [("b-path", collections.OrderedDict), ("a-obj", dict)]


def test_extensions_register_and_unregister():
    reg: Registry[object] = Registry("thing", built_in={"x": int})
    reg.register("y")(str)
    assert reg.names() == ["x", "y"] and list(reg) == ["x", "y"]
    for taken in ("x", "y"):
        with pytest.raises(UsageError, match="registered twice"):
            reg.register(taken)(float)
    assert reg.register("y")(str) is str and reg.register("x")(int) is int  # the same again
    assert reg.names() == ["x", "y"]
    assert reg.unregister("y") is str and "y" not in reg
    with pytest.raises(UsageError, match="built in"):
        reg.unregister("x")
    with pytest.raises(UsageError, match="unknown thing 'z'; valid choices: x"):
        reg.unregister("z")


def test_an_unknown_name_lists_the_valid_ones():
    reg: Registry[object] = Registry("thing", built_in={"x": int, "w": str})
    with pytest.raises(UsageError, match="unknown thing 'q'; valid choices: x, w"):
        reg.get("q")


@pytest.mark.parametrize("module, table", [
    ("privfedcal.algorithms.algorithm", "ALGORITHMS"),
    ("privfedcal.federation.hooks", "CALIBRATORS"),
    ("privfedcal.models.model_registry", "MODELS"),
    ("privfedcal.attacks.release_attacks", "RELEASE_ATTACKS"),
    ("privfedcal.privacy.stage_registry", "STAGES"),
])
def test_package_tables_import_nothing_until_looked_up(module: str, table: str):
    """Looking names up imports no built-in; every built-in path resolves."""
    code = (f"import sys, importlib; m = importlib.import_module({module!r}); t = m.{table}; "
            "before = set(sys.modules); names = t.names(); "
            "assert set(sys.modules) == before, sorted(set(sys.modules) - before); "
            "[t.get(n) for n in names]; print(len(names))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) > 2


def test_methods_and_calibrators_are_listed_under_their_own_name():
    from privfedcal.algorithms import ALGORITHMS
    from privfedcal.federation.hooks import CALIBRATORS

    assert all(cls.name == name for name, cls in ALGORITHMS.items())
    assert all(getattr(cls, "name", name) == name for name, cls in CALIBRATORS.items()
               if name != "none")
