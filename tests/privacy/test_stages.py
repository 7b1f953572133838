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
