"""The transcript records what the server sees of model updates (docs/privacy.md): the round's
global state and participants, every participant's full local state with the aggregation
weight and the public recipe; under --dp-train the weights are uniform (sizes stay private)."""

from __future__ import annotations

import torch

from privfedcal.experiment import build_simulator
from privfedcal.federation.aggregate import weighted_average
from privfedcal.privacy.transcript import load_transcript


def run(tmp_path, cfg):
    sim = build_simulator(cfg, tmp_path / "run")
    sim.run()
    return sim, load_transcript(tmp_path / "run" / "server" / "transcript")


def test_model_updates_are_recorded_with_weights_and_recipe(tmp_path, tiny_cfg):
    cfg = tiny_cfg(transcript=True, participation=0.5, rounds=2, momentum=0.0)
    sim, entries = run(tmp_path, cfg)
    rounds = [e for e in entries if e["label"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2]
    states = {e["round"]: e for e in rounds}
    for r in (1, 2):
        participants = states[r]["participants"]
        assert participants == sim.select_clients(r) and len(participants) == 2
        updates = [e for e in entries if e["label"] == "model-update" and e["round"] == r]
        assert [e["client"] for e in updates] == participants
        for e in updates:
            assert e["view"] == "plain-upload"
            assert e["weight"] == float(sim.exp.parts[e["client"]].numel())
            spec = sim.exp.spec
            assert (e["local_epochs"], e["batch_size"], e["lr"]) == (1, 32, spec.training.lr)
            assert spec.training.lr > 0
            assert set(e["tensors"]) == set(states[r]["tensors"])
            assert e["bytes"] == sum(v.numel() * v.element_size() for v in e["tensors"].values())
        # the next round's global state is the weighted average of what was recorded
        nxt = states.get(r + 1)
        if nxt is not None:
            avg = weighted_average([e["tensors"] for e in updates], [e["weight"] for e in updates])
            for k, v in avg.items():
                if v.is_floating_point():
                    torch.testing.assert_close(nxt["tensors"][k], v.to(nxt["tensors"][k].dtype),
                                               rtol=1e-5, atol=1e-6)


def test_dp_train_uses_uniform_weights(tmp_path, tiny_cfg):
    cfg = tiny_cfg(transcript=True, dp_eps=8.0, dp_train=True, rounds=1)
    _, entries = run(tmp_path, cfg)
    updates = [e for e in entries if e["label"] == "model-update"]
    assert len(updates) == cfg.data.clients
    assert {e["weight"] for e in updates} == {1.0}
