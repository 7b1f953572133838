"""--secagg-updates: model updates aggregated as CKKS sums; the server sees the aggregate and
the summed weight only, and the result equals the plaintext weighted average (up to the key
holder's flooding)."""

from __future__ import annotations

import torch

from privfedcal.experiment import build_simulator
from privfedcal.privacy.transcript import load_transcript


def test_secure_update_aggregation_matches_plain_fedavg(tmp_path, tiny_cfg):
    plain = build_simulator(tiny_cfg(rounds=1), tmp_path / "a")
    plain.run()
    # the same partition (a protected run draws its data seed from OS entropy otherwise)
    cfg = tiny_cfg(rounds=1, secagg_updates=True, transcript=True, data_seed=plain.cfg.seed)
    sec = build_simulator(cfg, tmp_path / "b")
    summary = sec.run()
    for k, v in plain.global_state.items():
        if v.is_floating_point():
            torch.testing.assert_close(sec.global_state[k], v, atol=1e-3, rtol=0)
    entries = [e for e in load_transcript(tmp_path / "b" / "server" / "transcript")
               if e["label"] == "model-update"]
    views = [e["view"] for e in entries]
    assert views.count("ciphertext") == cfg.clients and views.count("aggregate") == 1
    assert "plain-upload" not in views
    (agg,) = [e for e in entries if e["view"] == "aggregate"]
    sizes = sum(int(p.numel()) for p in sec.exp.parts)
    assert abs(agg["weight_sum"] - sizes) < 0.1  # only the sum of the n_k
    for k, v in sec.global_state.items():  # the aggregate is the state the server obtained
        torch.testing.assert_close(agg["tensors"][k], v.cpu())
    assert summary["privacy"]["secagg_updates"]["rounds"] == 1
