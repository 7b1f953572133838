"""The uplink as an ordered list of stages: client halves in order, server halves reversed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from privfedcal.errors import UsageError
from privfedcal.privacy.stages import BoundStage, ClearWire, NoiseStage, Release, Stage
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.uplink import Uplink


@dataclass
class Recording(Stage):
    """A toy stage: adds ``shift`` on the client, subtracts it on the server, and logs every
    call in ``calls`` (shared between stages, so the order across stages shows)."""

    tag: str
    shift: float
    calls: list = field(default_factory=list)

    def open(self, rel: Release) -> None:
        self.calls.append(("open", self.tag))

    def client(self, payload, rel):
        self.calls.append(("client", self.tag, rel.client))
        return {k: v + self.shift for k, v in payload.items()}

    def server(self, total, rel):
        self.calls.append(("server", self.tag))
        # each of the rel.arrived uploads carried one shift
        return {k: v - self.shift * rel.arrived for k, v in total.items()}

    def close(self, rel: Release) -> None:
        self.calls.append(("close", self.tag))


def test_server_halves_run_in_reverse_order_of_client_halves():
    calls: list = []
    up = Uplink([Recording("a", 1.0, calls), Recording("b", 10.0, calls), ClearWire()])
    uploads = [(c, {"x": torch.full((2,), float(c), dtype=torch.float64)}) for c in (4, 7)]
    total = up.aggregate(uploads, round_=1, label="x", transcript=Transcript(None))
    assert calls == [("open", "a"), ("open", "b"),
                     ("client", "a", 4), ("client", "b", 4),
                     ("client", "a", 7), ("client", "b", 7),
                     ("server", "b"), ("server", "a"),
                     ("close", "a"), ("close", "b")]
    # 4 + 7, both shifts undone: the layers nest and cancel
    torch.testing.assert_close(total["x"], torch.full((2,), 11.0, dtype=torch.float64))


def test_the_server_sees_uploads_after_every_client_half(tmp_path):
    """The transcript records what crossed the wire: 3 + 1 + 10 for client 3."""
    from privfedcal.privacy.transcript import load_transcript

    tr = Transcript(tmp_path / "t")
    up = Uplink([Recording("a", 1.0), Recording("b", 10.0), ClearWire()])
    up.aggregate([(3, {"x": torch.tensor([3.0])}), (5, {"x": torch.tensor([5.0])})],
                 round_=2, label="x", transcript=tr)
    tr.flush()
    seen = {e["client"]: float(e["tensors"]["x"]) for e in load_transcript(tr.directory)}
    assert seen == {3: 14.0, 5: 16.0}


def test_the_uplink_ends_in_exactly_one_wire():
    with pytest.raises(UsageError):
        Uplink([BoundStage()])
    with pytest.raises(UsageError):
        Uplink([ClearWire(), ClearWire()])


def test_a_stage_must_declare_both_halves():
    class ClientOnly(Stage):
        def client(self, payload, rel):
            return payload

    with pytest.raises(TypeError):
        ClientOnly()


def test_default_uplink_is_bound_then_clear():
    assert [type(s) for s in Uplink().stages] == [BoundStage, ClearWire]
    assert Uplink().find(NoiseStage) is None


# --- the stage registry: a stage's own file is all it takes ---------------------------

def _plan(**kw):
    from types import SimpleNamespace

    from privfedcal.privacy.dp import L2Clip
    from privfedcal.privacy.stages import StagePlan

    cfg = SimpleNamespace(seed=3, insecure_seeded_noise=False)
    return StagePlan(cfg=cfg, bound=L2Clip({"feature": 1.0}), **kw)


def test_planned_stages_follow_the_plan():
    from privfedcal.privacy.secagg_stage import EncryptStage
    from privfedcal.privacy.stages import planned_stages

    assert [type(s) for s in planned_stages(_plan())] == [BoundStage, ClearWire]
    from types import SimpleNamespace

    dp, secagg = object(), SimpleNamespace(min_clients=2)  # stand-ins: the stages store them
    assert [type(s) for s in planned_stages(_plan(dp=dp))] == [BoundStage, NoiseStage, ClearWire]
    stages = planned_stages(_plan(dp=dp, secagg=secagg))
    assert [type(s) for s in stages] == [BoundStage, NoiseStage, EncryptStage]
    assert stages[1].dp is dp and stages[1].seed == 3 and stages[2].secagg is secagg


def test_a_new_stage_class_takes_its_place_by_its_order(monkeypatch):
    from privfedcal.privacy import stages as mod

    monkeypatch.setattr(mod, "STAGE_CLASSES", list(mod.STAGE_CLASSES))

    @dataclass
    class Padding(Recording):
        order = 500

        @classmethod
        def plan(cls, plan):
            return cls("pad", 0.0) if plan.dp is not None else None

    class Unordered(Recording):  # no order: a helper class, never planned
        pass

    assert Padding in mod.STAGE_CLASSES and Unordered not in mod.STAGE_CLASSES
    assert [type(s) for s in mod.planned_stages(_plan())] == [BoundStage, ClearWire]
    assert [type(s) for s in mod.planned_stages(_plan(dp=object()))] == [
        BoundStage, NoiseStage, Padding, ClearWire]


def test_a_plan_must_end_in_exactly_one_wire(monkeypatch):
    from privfedcal.privacy import stages as mod

    monkeypatch.setattr(mod, "STAGE_CLASSES", list(mod.STAGE_CLASSES))

    class LateStage(Recording):
        order = 2000  # after the wire

        @classmethod
        def plan(cls, plan):
            return cls("late", 0.0)

    with pytest.raises(RuntimeError, match="exactly one wire"):
        mod.planned_stages(_plan())


def test_planned_stages_imports_every_stage_module():
    # in a fresh interpreter: the encrypt stage's module is found by its name, not imported
    # by the planner
    import subprocess
    import sys

    code = ("import sys; from privfedcal.privacy.stages import planned_stages; "
            "from tests.privacy.test_stages import _plan; "
            "assert 'privfedcal.privacy.secagg_stage' not in sys.modules; "
            "planned_stages(_plan()); "
            "assert 'privfedcal.privacy.secagg_stage' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
