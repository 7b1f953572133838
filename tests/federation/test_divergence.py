"""The divergence guard: a deliberately exploding run stops at the round where numbers stop
being finite, keeps what was finite and never reports the NaN model's accuracy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from privfedcal.errors import Diverged
from privfedcal.experiment import build_experiment
from privfedcal.federation import divergence
from privfedcal.federation.checkpoint import load_checkpoint
from privfedcal.federation.hooks import Calibrator
from privfedcal.federation.local import LocalResult
from privfedcal.federation.simulator import Simulator
from privfedcal.tensors import nonfinite_key


def test_nonfinite_key_finds_nan_and_inf_only_in_floats():
    ok = {"a": torch.ones(3), "n": torch.tensor([1, 2])}
    assert nonfinite_key(ok) is None
    assert nonfinite_key({**ok, "b": torch.tensor([1.0, math.inf])}) == "b"
    assert nonfinite_key({"c": torch.tensor([math.nan]), **ok}) == "c"


def test_check_local_names_the_client():
    good = LocalResult({"w": torch.ones(2)}, None, 0.5)
    bad_loss = LocalResult({"w": torch.ones(2)}, None, math.nan)
    with pytest.raises(Diverged) as exc:
        divergence.check_local([good, bad_loss], [3, 7], None, 4, 0.1)
    assert (exc.value.round, exc.value.client) == (4, 7)
    assert "--lr" in str(exc.value) and "round 4, client 7" in str(exc.value)
    bad_state = LocalResult({"w": torch.tensor([1.0, math.nan])}, None, 0.5)
    with pytest.raises(Diverged) as exc:
        divergence.check_local([good, bad_state], [3, 7], None, 2, 0.1)
    assert exc.value.client == 7 and "w" in exc.value.what
    divergence.check_local([good, good], [0, 1], {"w": torch.ones(2)}, 1, 0.1)  # quiet
    with pytest.raises(Diverged) as exc:  # only the average overflowed: no client to name
        divergence.check_local([good, good], [0, 1], {"w": torch.tensor([math.inf])}, 3, 0.1)
    assert exc.value.client is None and exc.value.round == 3


def test_check_payload_and_evaluation():
    divergence.check_payload({"s": torch.zeros(2)}, 1, "ccvr-stats")
    with pytest.raises(Diverged, match="ccvr-stats"):
        divergence.check_payload({"s": torch.tensor([math.inf])}, 5, "ccvr-stats")
    with pytest.raises(Diverged, match="test loss"):
        divergence.check_evaluation({"loss": math.nan, "accuracy": 0.1}, 3, 0.05)


def test_exploding_lr_stops_the_run(tiny_cfg, tmp_path):
    sim = Simulator(build_experiment(tiny_cfg(lr=50.0, rounds=3)), tmp_path)
    with pytest.raises(Diverged) as exc:
        sim.run()
    assert exc.value.round == 1 and exc.value.client is not None
    assert exc.value.checkpoint_round == 0 and not (tmp_path / "checkpoint").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["diverged"]["round"] == 1 and summary["accuracy"] is None
    assert "--lr" in summary["diverged"]["hint"]
    assert not (tmp_path / "final").exists()  # no final model of a NaN run


class NaNHeadFromRound2(Calibrator):
    """A calibrator whose re-trained classifier turns non-finite in round 2 (a stand-in for a
    re-training that blew up): the guard must catch it before evaluation."""

    round = 0

    def after_round(self, ctx):
        self.round = ctx.round

    def eval_state(self, global_state):
        if self.round < 2:
            return global_state
        state = dict(global_state)
        key = next(k for k in state if k.startswith("classifier") and k.endswith("weight"))
        state[key] = torch.full_like(state[key], math.nan)
        return state


def test_calibration_divergence_keeps_last_finite_round(tiny_cfg, tmp_path):
    sim = Simulator(build_experiment(tiny_cfg(rounds=3)), tmp_path,
                    calibrator=NaNHeadFromRound2())
    with pytest.raises(Diverged) as exc:
        sim.run()
    assert exc.value.round == 2 and "re-trained classifier" in exc.value.what
    assert exc.value.checkpoint_round == 1  # what the CLI's message reports as kept
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["diverged"]["round"] == 2
    assert summary["last_finite_evaluation"]["round"] == 1
    assert 0 <= summary["last_finite_evaluation"]["accuracy"] <= 1
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1]
    ck = load_checkpoint(tmp_path / "checkpoint")
    assert ck["round"] == 1
    assert all(torch.isfinite(v).all() for v in ck["global"].values() if v.is_floating_point())
