"""The round loop: reproducibility, resume, workers, aggregation."""

from __future__ import annotations

import json

import torch

from privfedcal.experiment import build_experiment
from privfedcal.federation.simulator import Simulator
from privfedcal.seeding import derive_seed


def run(cfg, path):
    sim = Simulator(build_experiment(cfg), path)
    summary = sim.run()
    return sim, summary


def states_equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)


def test_derive_seed_distinguishes_parts():
    seeds = {derive_seed(0, r, c, 1) for r in range(20) for c in range(20)}
    assert len(seeds) == 400
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3)


def test_same_seed_same_numbers(tiny_cfg, tmp_path):
    _, s1 = run(tiny_cfg(), tmp_path / "a")
    _, s2 = run(tiny_cfg(), tmp_path / "b")
    assert s1["accuracy"] == s2["accuracy"]
    assert s1["per_class_accuracy"] == s2["per_class_accuracy"]
    _, s3 = run(tiny_cfg(seed=1), tmp_path / "c")
    assert s3["per_class_accuracy"] != s1["per_class_accuracy"] or s3["loss"] != s1["loss"]


def test_run_folder_contents(tiny_cfg, tmp_path):
    sim, summary = run(tiny_cfg(eval_every=1), tmp_path / "r")
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]
    for key in ("round", "accuracy", "loss", "seconds"):
        assert key in json.loads(lines[0])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert 0.0 <= s["accuracy"] <= 1.0 and len(s["per_class_accuracy"]) == 10
    assert (tmp_path / "r" / "checkpoint" / "state.safetensors").is_file()


def test_learning_happens(tiny_cfg, tmp_path):
    _, summary = run(tiny_cfg(rounds=5, alpha=1.0), tmp_path / "r")
    assert summary["accuracy"] > 0.7  # digits is easy; chance is 0.1


def test_resume_reaches_same_result(tiny_cfg, tmp_path):
    full = Simulator(build_experiment(tiny_cfg(rounds=3, method="moon")), tmp_path / "full")
    full.run()
    # interrupted: the same config, stopped after round 2 (a 2-round run's checkpoint)
    part_cfg = tiny_cfg(rounds=3, method="moon")
    part = Simulator(build_experiment(part_cfg.replace(rounds=2)), tmp_path / "part")
    part.run()
    resumed = Simulator(build_experiment(part_cfg), tmp_path / "part")
    resumed.restore()
    assert resumed.start_round == 3
    resumed.run()
    assert states_equal(full.global_state, resumed.global_state)


def test_a_resumed_run_without_transcript_counts_the_whole_run(tiny_cfg, tmp_path):
    """--no-transcript keeps the server's view in memory only: a run resumed from its
    checkpoint still reports every round's upload bytes and checks every secure sum (it
    counted only those after the resume, and saw one secure sum of three)."""
    import privfedcal
    from privfedcal.experiment import build_simulator

    cfg = tiny_cfg(rounds=3, method="creff", secagg=True)
    full = build_simulator(cfg, tmp_path / "full").run()
    build_simulator(cfg.replace(rounds=2), tmp_path / "part").run()
    resumed = privfedcal.resume_simulator(tmp_path / "part", rounds=3).run()
    assert full["privacy"]["whole_run"]["secure_sums"] == 3
    assert resumed["privacy"]["whole_run"]["secure_sums"] == 3
    # CKKS ciphertexts differ in size by a few bytes from draw to draw
    assert abs(resumed["uploaded_bytes"] / full["uploaded_bytes"] - 1) < 0.01


def test_a_run_stopped_after_its_post_training_release_resumes_without_a_second(
        tiny_cfg, tmp_path, monkeypatch):
    """CCVR's release is on file in the checkpoint as soon as it is made: a run stopped
    before its summary was written resumes with that release's result and its charge (it
    released again with fresh noise, charged once, while the server held both)."""
    import privfedcal
    import privfedcal.federation.simulator as simulator
    from privfedcal.experiment import build_simulator

    cfg = tiny_cfg(method="ccvr", dp_eps=8.0, transcript=True)
    whole = build_simulator(cfg, tmp_path / "whole").run()

    def stop(*_a, **_kw):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(simulator, "write_summary", stop)
        try:
            build_simulator(cfg, tmp_path / "run").run()
        except KeyboardInterrupt:
            pass
    resumed = privfedcal.resume_simulator(tmp_path / "run").run()
    index = json.loads((tmp_path / "run" / "server" / "transcript" / "index.json").read_text())
    uploads = [e["client"] for e in index if e["view"] == "plain-upload"
               and e["label"] == "ccvr-stats"]
    assert sorted(uploads) == [0, 1, 2, 3]  # each client's noisy statistics, once
    assert resumed["privacy"]["epsilon_spent"] == whole["privacy"]["epsilon_spent"] <= 8.0
    assert resumed["accuracy_before_calibration"] == whole["accuracy_before_calibration"]


def test_participation_samples_clients(tiny_cfg, tmp_path):
    sim = Simulator(build_experiment(tiny_cfg(participation=0.5)), tmp_path / "r")
    chosen = [sim.select_clients(r) for r in range(1, 6)]
    assert all(len(c) == 2 for c in chosen)
    assert len({tuple(c) for c in chosen}) > 1
    assert chosen == [sim.select_clients(r) for r in range(1, 6)]


def test_workers_give_same_numbers(tiny_cfg, tmp_path):
    sim1, s1 = run(tiny_cfg(workers=1, threads=1), tmp_path / "w1")
    sim2, s2 = run(tiny_cfg(workers=2, threads=1), tmp_path / "w2")
    assert states_equal(sim1.global_state, sim2.global_state)
    assert s1["accuracy"] == s2["accuracy"]
