"""--secagg-updates: model updates aggregated as CKKS sums; the server sees the aggregate and
the summed weight only, and the result equals the plaintext weighted average (up to the key
holder's flooding). The updates go through the same uplink as the calibration releases
(privfedcal/privacy/planner.py ``updates_plan``, privacy/secagg_updates.py ``SecureUpdates``: the encrypt wire, fresh keys, the key holder's
minimum)."""

from __future__ import annotations

import torch

from privfedcal.experiment import build_simulator
from privfedcal.privacy.secagg_updates import UPDATE_WEIGHT, SecureUpdates
from privfedcal.privacy.transcript import load_transcript
from privfedcal.settings.floors import PrivacyOptions


def test_secure_update_aggregation_matches_plain_fedavg(tmp_path, tiny_cfg):
    plain = build_simulator(tiny_cfg(rounds=1), tmp_path / "a")
    plain.run()
    # the same partition (a protected run draws its data seed from OS entropy otherwise)
    cfg = tiny_cfg(rounds=1, secagg_updates=True, transcript=True,
                   data_seed=plain.loop.training.seed)
    sec = build_simulator(cfg, tmp_path / "b")
    summary = sec.run()
    for k, v in plain.global_state.items():
        if v.is_floating_point():
            torch.testing.assert_close(sec.global_state[k], v, atol=1e-3, rtol=0)
    entries = [e for e in load_transcript(tmp_path / "b" / "server" / "transcript")
               if e["label"] == "model-update"]
    views = [e["view"] for e in entries]
    assert views.count("ciphertext") == cfg.data.clients and views.count("aggregate") == 1
    assert "plain-upload" not in views
    (agg,) = [e for e in entries if e["view"] == "aggregate"]
    assert agg["clients"] == cfg.data.clients
    sizes = sum(int(p.numel()) for p in sec.exp.parts)
    weight = float(agg["tensors"][UPDATE_WEIGHT][0])
    assert abs(weight - sizes) < 0.1  # only the sum of the n_k
    for k, v in sec.global_state.items():  # the aggregate over its weight: the new state
        if v.is_floating_point():
            torch.testing.assert_close((agg["tensors"][k] / weight).float(), v.cpu())
    privacy = summary["privacy"]["secagg_updates"]
    assert privacy["rounds"] == 1 and privacy["scheme"] == "CKKS (TenSEAL)"
    assert privacy["min_clients"] == cfg.privacy.secagg_min_clients


def test_a_sum_below_the_key_holders_minimum_keeps_the_global_state(tmp_path, tiny_cfg):
    """The key holder decrypts no sum of fewer than its minimum: with one client left in the
    round the release is skipped and the global state stays (no aggregate of one)."""
    from privfedcal.errors import ReleaseSkipped
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.cohorts import cohort_plan
    from privfedcal.privacy.planner import protection_inputs, updates_plan
    from privfedcal.privacy.releases import UPDATE_RELEASE
    from privfedcal.privacy.transcript import Transcript

    cfg = tiny_cfg(rounds=1, secagg_updates=True, data_seed=0)
    sim = build_simulator(cfg, tmp_path / "c")
    up = sim.uplink
    sent = {k: v.clone() for k, v in sim.global_state.items()}
    moved = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in sent.items()}
    out = up.average_updates(sent, [moved], [3.0], [0], round_=1,
                             transcript=Transcript(None))
    for k, v in sent.items():
        assert torch.equal(out[k], v)
    assert up.skipped[-1]["label"] == UPDATE_RELEASE
    # a sum of two is decrypted (weights of the size of clients: the CKKS error is absolute
    # on the sum, so it is divided by the weight sum)
    pair = list(cohort_plan(sim.exp.privacy).cohorts[0])  # a sum holds whole cohorts
    out = up.average_updates(sent, [moved, moved], [600.0, 700.0], pair, round_=1,
                             transcript=Transcript(None))
    k = next(k for k, v in sent.items() if v.is_floating_point())
    torch.testing.assert_close(out[k], moved[k], atol=1e-3, rtol=0)
    opts = protection_inputs(PrivacyOptions.of(cfg), calibrator_class(cfg), sim.exp.num_examples)
    assert isinstance(SecureUpdates.of(updates_plan(opts)).uplink.wire.summary(), dict)
    assert ReleaseSkipped  # the error the uplink turns into a kept global state
