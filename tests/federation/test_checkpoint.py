"""federation/checkpoint.py: safe checkpoints (safetensors + a JSON skeleton, never pickle)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from privfedcal.errors import UsageError
from privfedcal.federation.checkpoint import (
    flatten,
    load_checkpoint,
    save_checkpoint,
    snapshot,
    unflatten,
)
from privfedcal.privacy.removals import wait_for_removals


def test_flatten_moves_tensors_to_path_keys_and_leaves_a_json_skeleton():
    a, b = torch.arange(3.0), torch.ones(2, 2)
    tensors: dict[str, torch.Tensor] = {}
    skel = flatten({"model": {"w": a}, "clients": [b, None], "round": 4, "name": "x"}, tensors)
    assert skel == {"model": {"w": {"__tensor__": "/model/w"}},
                    "clients": [{"__tensor__": "/clients/0"}, None], "round": 4, "name": "x"}
    assert list(tensors) == ["/model/w", "/clients/0"]
    assert torch.equal(tensors["/model/w"], a) and torch.equal(tensors["/clients/0"], b)
    assert json.loads(json.dumps(skel)) == skel
    back = unflatten(skel, tensors)
    assert back["round"] == 4 and back["clients"][1] is None
    assert torch.equal(back["model"]["w"], a)
    # a bare tensor gets the key "_"; tuples come back as lists
    t: dict[str, torch.Tensor] = {}
    assert flatten(a, t) == {"__tensor__": "_"} and list(t) == ["_"]
    assert unflatten(flatten((1, 2), {}), {}) == [1, 2]


def test_save_load_round_trip_and_files(tmp_path):
    w = torch.randn(3, 4)
    shared = torch.arange(6.0)
    payload = {"global": {"fc.weight": w, "view": shared[:3]}, "round": 7,
               "history": [{"round": 1, "accuracy": 0.5}], "calibrator": {}}
    d = tmp_path / "checkpoint"
    save_checkpoint(d, payload)
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "state.safetensors"]
    assert sorted(load_file(str(d / "state.safetensors"))) == ["/global/fc.weight",
                                                                "/global/view"]
    out = load_checkpoint(d)
    assert out["round"] == 7 and out["history"] == [{"round": 1, "accuracy": 0.5}]
    assert out["calibrator"] == {}
    assert torch.equal(out["global"]["fc.weight"], w)
    assert torch.equal(out["global"]["view"], torch.tensor([0.0, 1.0, 2.0]))


def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path):
    d = tmp_path / "ck"
    save_checkpoint(d, {"round": 1, "x": torch.zeros(2)})
    save_checkpoint(d, {"round": 2, "x": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    out = load_checkpoint(d)
    assert out["round"] == 2 and torch.equal(out["x"], torch.ones(2))
    # a stale temporary from an interrupted save is discarded, not loaded
    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "junk").write_text("x")
    save_checkpoint(d, {"round": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert load_checkpoint(d) == {"round": 3}


def test_missing_or_corrupt_checkpoint_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope")
    d = tmp_path / "ck"
    save_checkpoint(d, {"x": torch.zeros(2)})
    (d / "state.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(UsageError, match="cannot read checkpoint"):
        load_checkpoint(d)


def test_ctrl_c_during_the_swap_waits_for_it(tmp_path, monkeypatch):
    """SIGINT between the two renames would leave only ``checkpoint.old``: it is held back
    until the new checkpoint is in place, then raised."""
    import os
    import signal

    import privfedcal.federation.checkpoint as ck

    save_checkpoint(tmp_path / "checkpoint", {"round": 1, "w": torch.zeros(2)})
    real_replace = os.replace
    calls = []

    def replace_then_interrupt(src, dst):
        real_replace(src, dst)
        calls.append(dst)
        if len(calls) == 1:  # the old checkpoint moved aside, the new one not yet in place
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ck.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "checkpoint", {"round": 2, "w": torch.ones(2)})
    assert len(calls) == 2
    assert load_checkpoint(tmp_path / "checkpoint")["round"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_replaced_checkpoint_removed_in_the_background_is_gone_after_the_wait(tmp_path):
    """``background=True``: the old folder goes on a thread; a save waits for the previous
    removal, and ``wait_for_removals`` leaves the folder as a synchronous save does."""
    for r in range(4):
        save_checkpoint(tmp_path / "ck", {"round": r, "w": torch.full((3,), float(r))},
                        background=True)
        assert load_checkpoint(tmp_path / "ck")["round"] == r
    wait_for_removals()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_snapshot_is_not_changed_by_what_its_owner_does_next(tmp_path):
    """What the writer thread saves: new containers, tensors cloned (``clone=False``: the
    same tensors, for states that are only ever replaced)."""
    w, history = torch.zeros(3), [{"round": 1}]
    state = {"global": {"w": w}, "history": history, "pair": (1, w)}
    copy = snapshot(state)
    w.add_(1.0)
    history.append({"round": 2})
    history[0]["round"] = 7
    assert torch.equal(copy["global"]["w"], torch.zeros(3))
    assert torch.equal(copy["pair"][1], torch.zeros(3))
    assert copy["history"] == [{"round": 1}]
    kept = snapshot({"c": {"w": w}}, clone=False)
    assert kept["c"]["w"] is not w and kept["c"]["w"].data_ptr() == w.data_ptr()
    save_checkpoint(tmp_path / "ck", copy)
    assert load_checkpoint(tmp_path / "ck")["history"] == [{"round": 1}]
