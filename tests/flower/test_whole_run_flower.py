"""The whole-run guarantee of secure aggregation under Flower (docs/threat-model.md, "Secure
aggregation over a whole run"): CReFF with hidden counts at participation 0.5 for 6 rounds
over the loopback grid, where the key holder is client 0, a node that sees every decrypted
sum and knows its own upload. With cohorts no client's counts follow from the sums, not
even for the key holder. With the cohorts switched off, the check before each decryption
withholds every sum that would single a client out; with that check off too, the same least
squares recovers counts exactly."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")


def least_squares(sim, known=()) -> tuple[np.ndarray, np.ndarray]:
    """Per-client estimate of the hidden counts from every round's aggregate and its
    contributors (the server's transcript), with the public class totals and the values of
    ``known`` clients (what the key holder holds of its own) as more equations; and which
    clients that determines (unit vector in the row space)."""
    from privfedcal.experiment import config_of
    from privfedcal.privacy.transcript import load_transcript

    entries = load_transcript(sim.transcript.directory)
    clients = sim.loop.data.clients
    rows, sums, senders = [], [], {}
    for e in entries:
        key = (e["round"], e["label"])
        if e["view"] == "ciphertext":
            senders.setdefault(key, set()).add(e["client"])
        elif e["view"] == "aggregate" and "count" in e.get("tensors", {}):
            rows.append([float(c in senders[key]) for c in range(clients)])
            sums.append(e["tensors"]["count"].double().numpy())
    truth = true_counts(config_of(sim.exp))
    rows.append([1.0] * clients)
    sums.append(truth.sum(0))  # public: the training split's class histogram
    for k in known:
        rows.append([float(c == k) for c in range(clients)])
        sums.append(truth[k])
    a, b = np.asarray(rows), np.asarray(sums)
    estimate = np.linalg.lstsq(a, b, rcond=None)[0]
    return estimate, np.isclose(np.diag(np.linalg.pinv(a) @ a), 1.0, atol=1e-9)


def true_counts(cfg) -> np.ndarray:
    from privfedcal.experiment import build_experiment

    exp = build_experiment(cfg.replace(data_seed=0))
    classes = exp.data.num_classes
    return np.stack([np.bincount(exp.data.y_train[p].cpu().numpy(), minlength=classes)
                     for p in exp.parts]).astype(float)


CREFF = {"match_steps": 5, "retrain_steps": 5, "weighting": "sample"}


@pytest.mark.flower
def test_secure_sums_over_six_rounds_isolate_nothing_finer_than_a_cohort(
        flower_cfg, run_flower, monkeypatch, tmp_path):
    cfg = flower_cfg(method="creff", secagg=True, hide_counts=True, clients=6,
                     participation=0.5, rounds=6, transcript=True, calibration_params=CREFF)
    sim, summary, _ = run_flower(cfg)
    cohorts = summary["privacy"]["secagg"]["cohorts"]
    assert cohorts == [[0, 1, 2], [3, 4, 5]]  # the key holder's cohort: 2 others beside it
    assert summary["privacy"]["whole_run"]["holds"] is True
    truth = true_counts(cfg)
    for known in ((), (0,)):  # the server; the key holder, who knows its own counts
        estimate, determined = least_squares(sim, known)
        others = [c for c in range(6) if c not in known]
        assert not determined[others].any()
        assert all(np.abs(estimate[c] - truth[c]).max() > 1.0 for c in others)

    # mutation: rounds draw 3 of 6 clients one by one (the planner's checks disabled). The
    # check before each decryption withholds every sum that would isolate a client: the
    # run goes on without them, and its record holds
    import shutil

    import privfedcal.privacy.cohorts
    import privfedcal.privacy.planner
    from privfedcal.privacy.secagg_stage import WITHHELD, EncryptStage

    monkeypatch.setattr(privfedcal.privacy.cohorts, "secure_rounds", lambda cfg: False)
    monkeypatch.setattr(privfedcal.privacy.planner, "check_secure_aggregation", lambda *a: None)
    shutil.rmtree(tmp_path / "flower")  # run_flower's run folder: a fresh transcript
    sim, summary, _ = run_flower(cfg.replace(seed=1))
    assert summary["privacy"]["whole_run"]["holds"] is True
    withheld = [s for s in summary["skipped_releases"] if s["reason"].startswith(WITHHELD)]
    assert withheld and summary["rounds"] == 6
    _, determined = least_squares(sim, known=(0,))
    assert not determined[1:].any()

    # and with that check disabled as well, the same least squares recovers counts exactly
    monkeypatch.setattr(EncryptStage, "check_whole_run", lambda *a: None)
    shutil.rmtree(tmp_path / "flower")
    sim, summary, _ = run_flower(cfg.replace(seed=1))
    assert summary["privacy"]["whole_run"]["holds"] is False
    estimate, determined = least_squares(sim, known=(0,))
    assert determined[1:].any()
    exposed = [c for c in range(1, 6) if determined[c]]
    assert np.abs(estimate[exposed] - truth[exposed]).max() < 0.05
