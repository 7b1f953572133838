"""The stage registry: stages found by name, ordered by what each declares it follows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from privfedcal.errors import UsageError
from privfedcal.privacy import stage_registry as reg
from privfedcal.privacy.stage_registry import StageEntry, client_order, register_stage
from privfedcal.privacy.stages import ClearWire, Stage


@dataclass
class Passing(Stage):
    tag: str = "p"

    def client(self, payload, rel):
        return payload

    def server(self, total, rel):
        return total


def _entry(name, after=(), **kw):
    return StageEntry(name, lambda plan: (), lambda setup, shared: Passing(name), after=after,
                      **kw)


@pytest.fixture
def registry():
    """The registry, the stages a test registers taken out again after it."""
    before = set(reg.STAGES)
    yield reg.STAGES
    for name in set(reg.STAGES) - before:
        reg.STAGES.unregister(name)


def test_built_in_stages_in_client_order():
    assert client_order() [:2] == ["bound", "noise"]
    assert client_order(["encrypt", "noise", "bound"]) == ["bound", "noise", "encrypt"]
    assert client_order(["clear", "bound"]) == ["bound", "clear"]


def test_a_stage_takes_the_place_it_declares(registry):
    register_stage(_entry("late", after=("noise",)))
    register_stage(StageEntry("early", lambda plan: (), lambda setup, shared: Passing(),
                              after=("bound",), before=("noise",)))
    register_stage(_entry("between", after=("early",)))
    # "early" declares its place before noise; "between" follows it, and with no other
    # constraint takes its registration order (after noise and "late")
    assert client_order(["clear", "late", "between", "noise", "early", "bound"]) == [
        "bound", "early", "noise", "late", "between", "clear"]


def test_order_passes_through_stages_a_run_does_not_use(registry):
    register_stage(_entry("a", after=("noise",)))
    register_stage(_entry("b", after=("a",)))
    register_stage(_entry("c"))  # no constraint: registered last, but placed by ties only
    assert client_order(["b", "bound", "encrypt"]) == ["bound", "b", "encrypt"]


def test_unknown_names_and_cycles_are_refused(registry):
    with pytest.raises(UsageError, match="unknown stage 'nope'; valid choices: bound, noise, clear, encrypt"):
        client_order(["nope"])
    register_stage(_entry("x", after=("y",)))
    with pytest.raises(UsageError, match="'y', which is not registered"):
        client_order()
    register_stage(_entry("y", after=("x",)))
    with pytest.raises(UsageError, match="cycle"):
        client_order()


def test_a_taken_name_is_refused(registry):
    with pytest.raises(ValueError, match="registered twice"):
        register_stage(_entry("noise"))
    entry = _entry("twice")
    assert register_stage(entry) is register_stage(entry)  # the same entry again: no change


def test_an_entry_cannot_follow_itself():
    with pytest.raises(ValueError):
        _entry("loop", after=("loop",))


def test_opt_in_stages_are_listed(registry):
    assert "noise" not in reg.opt_in_stages()
    register_stage(_entry("extra", opt_in=True))
    assert "extra" in reg.opt_in_stages()


def test_built_in_wires_build_live_stages():
    from privfedcal.privacy.stage_registry import Shared

    assert isinstance(reg.get_stage("clear").build((), Shared()), ClearWire)
