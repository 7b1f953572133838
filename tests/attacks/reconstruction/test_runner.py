"""Transcript -> targets -> attacks -> records, on tiny digits runs.

Targets are checked against statistics computed independently (numpy on the features of
the client's true images), scores against hand-computed PSNRs, the secure-aggregation path
on a transcript rewritten the way the encrypted uplink records it (ciphertext sizes plus
the decrypted sum), and every user error is a one-line UsageError.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from privfedcal.attacks.reconstruction.gradients_attack import GradientsOptions, plan_gradients
from privfedcal.attacks.reconstruction.runner import (
    RunView,
    UploadedFeatures,
    execute,
    load_run,
)
from privfedcal.attacks.reconstruction.scoring import score
from privfedcal.attacks.reconstruction.stats_attack import StatsOptions, plan_stats
from privfedcal.attacks.reconstruction.updates_attack import UpdatesOptions, plan_model_updates
from privfedcal.attacks.reconstruction.uploads import infer_class_sets
from privfedcal.calibration.ccvr import CCVR_RELEASE as STATS_LABEL
from privfedcal.calibration.creff import CREFF_RELEASE as GRAD_LABEL
from privfedcal.cli.main import main
from privfedcal.errors import UsageError

FAST = ["--clients", "3", "--rounds", "1", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--dataset", "digits"]
TINY = StatsOptions(steps=5, restarts=1, raw_samples=1)
TINY_GRAD = GradientsOptions(steps=5, restarts=1)


@pytest.fixture(scope="module")
def ccvr_view(tmp_path_factory) -> RunView:
    run = tmp_path_factory.mktemp("runner") / "ccvr"
    main(["train", *FAST, "--method", "ccvr", "--out", str(run)])
    return load_run(run)


@pytest.fixture(scope="module")
def creff_view(tmp_path_factory) -> RunView:
    run = tmp_path_factory.mktemp("runner") / "creff"
    # without DSA: the tests below recompute the uploads from the clients' raw images
    main(["train", *FAST, "--rounds", "2", "--method", "creff", "--match-steps", "5",
          "--retrain-steps", "5", "--creff-dsa", "none", "--out", str(run)])
    return load_run(run)


def true_features(view: RunView, client: int | None, cls: int) -> np.ndarray:
    rel = view.release(STATS_LABEL, None)
    view.load_state(rel.state)
    idx = view.truth(client, cls)
    with torch.no_grad():
        return view.model.features(view.truth_exp.data.x_train[idx]).double().numpy()


def test_releases_group_model_state_and_uploads(ccvr_view):
    (rel,) = ccvr_view.releases(STATS_LABEL)
    assert rel.round == 1 and sorted(rel.uploads) == [0, 1, 2] and rel.aggregate is None
    assert set(rel.state) == set(ccvr_view.model.state_dict())
    with pytest.raises(UsageError, match="rounds: 1"):
        ccvr_view.release(STATS_LABEL, 7)
    with pytest.raises(UsageError, match="no 'creff-grad' release"):
        ccvr_view.release(GRAD_LABEL, None)


def test_noise_stds_follow_the_gaussian_mechanism_scale():
    # std_k = z * sqrt(K) * sensitivity_k (privacy/dp.py); by hand for z = 2, R = 3, G = 0.5
    view = RunView(Path("x"), None, {"privacy": {
        "noise_multipliers": {STATS_LABEL: 2.0, GRAD_LABEL: 2.0},
        "feature_clip": 3.0, "grad_clip": 0.5}}, None, [])
    stats = view.noise_stds(STATS_LABEL, ["count", "sum", "outer"])
    r3 = 2 * math.sqrt(3)
    assert stats == pytest.approx({"count": r3, "sum": 3 * r3, "outer": 9 * r3})
    # CReFF's release gives its gradients 0.9 of the noise budget, holders 0.1
    # (calibration/creff.py NOISE_SHARE): std_k = z * s_k / sqrt(share_k)
    grads = view.noise_stds(GRAD_LABEL, ["grad", "holders"])
    assert grads == pytest.approx({"grad": 2 * 0.5 / math.sqrt(0.9),
                                   "holders": 2 / math.sqrt(0.1)})
    plain = RunView(Path("x"), None, {}, None, [])
    assert plain.noise_stds(STATS_LABEL, ["count"]) == {"count": 0.0}


def test_stats_targets_equal_independent_class_statistics(ccvr_view):
    plan = plan_stats(ccvr_view, TINY, clients=[0])
    held = [c for c in range(10) if ccvr_view.truth_exp.counts[0][c] > 0]
    means = [j for j in plan.jobs if j.base["target"] == "class-mean"]
    stats = [j for j in plan.jobs if j.base["target"] == "class-stats"]
    raws = [j for j in plan.jobs if j.base["target"] == "raw-feature"]
    assert [j.base["class"] for j in means] == held and len(raws) == len(held)
    for jm, js in zip(means, stats, strict=True):
        z = true_features(ccvr_view, 0, jm.base["class"])
        assert jm.target.n == js.target.n == z.shape[0] == jm.base["n_true"]
        np.testing.assert_allclose(jm.target.mean.numpy(), z.mean(0), rtol=1e-5, atol=1e-5)
        if z.shape[0] > 1:
            np.testing.assert_allclose(js.target.cov.numpy(), np.cov(z, rowvar=False),
                                       rtol=1e-4, atol=1e-5)
    assert all(j.base["client"] == 0 and j.base["view"] == "plain-upload" for j in means)


def test_stats_attack_records(ccvr_view):
    cls = int(np.flatnonzero(ccvr_view.truth_exp.counts[1])[0])
    plan = plan_stats(ccvr_view, TINY, clients=[1], classes=[cls])
    results = execute(plan)
    assert [r.record["target"] for r in results] == ["raw-feature", "class-mean", "class-stats"]
    n = int(ccvr_view.truth_exp.counts[1][cls])
    for r in results:
        rec = r.record
        for key in ("client", "class", "n", "psnr", "ssim", "feature_cosine",
                    "nearest_is_true", "prior_psnr", "target_cosine"):
            assert key in rec, key
        assert rec["client"] == 1 and rec["class"] == cls and math.isfinite(rec["psnr"])
        assert r.recon.shape == r.truth.shape
    assert len(results[2].record["psnr_per_image"]) == results[2].recon.shape[0] == n


def test_score_matches_hand_computed_psnr(ccvr_view):
    view = ccvr_view
    view.load_state(view.release(STATS_LABEL, None).state)
    idx = view.truth(0, int(np.flatnonzero(view.truth_exp.counts[0])[0]))[:3]
    truth = view.pixels(idx)
    recon = 0.9 * truth + 0.05
    mse = ((recon - truth) ** 2).flatten(1).mean(1).double().numpy()
    expected = 10 * np.log10(1 / mse)
    rec, matched = score(view, recon, idx, paired=True)
    np.testing.assert_allclose(rec["psnr_per_image"], expected, atol=1e-3)
    assert torch.equal(matched, truth)
    perm = torch.tensor([2, 0, 1])
    rec2, matched2 = score(view, recon[perm], idx, paired=False)  # Hungarian undoes perm
    np.testing.assert_allclose(rec2["psnr_per_image"], expected[perm.numpy()], atol=1e-3)
    assert torch.equal(matched2, truth[perm]) and rec2["nearest_is_true"] == 1.0
    label = int(view.truth_exp.data.y_train[idx[0]])
    d = view.truth_exp.data
    prior = d.denormalize(d.x_test[d.y_test == label].mean(0)).clamp(0, 1)
    expected_prior = np.mean([10 * np.log10(1 / float(((prior - t) ** 2).mean())) for t in truth])
    assert rec["prior_psnr"] == pytest.approx(expected_prior, abs=1e-3)


def test_class_sets_of_plain_uploads_are_exact(ccvr_view):
    records, notes = infer_class_sets(ccvr_view, TINY)
    assert notes == [] and [r["client"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["accuracy"] == r["precision"] == r["recall"] == 1.0 and r["count_mae"] == 0.0
        assert r["true_counts"] == [int(v) for v in ccvr_view.truth_exp.counts[r["client"]]]


def secagg_copy(view: RunView, dest: Path) -> Path:
    """The run with its transcript rewritten as the encrypted uplink records it."""
    shutil.copytree(view.run_dir, dest)
    tdir = dest / "server" / "transcript"
    entries = json.loads((tdir / "index.json").read_text())
    rel = view.release(STATS_LABEL, None)
    total = {k: sum(u[k] for u in rel.uploads.values()) for k in ("count", "sum", "outer")}
    save_file(total, str(tdir / "agg.safetensors"))
    kept = [e for e in entries if e["view"] == "model-state"]
    kept += [{"round": 1, "label": STATS_LABEL, "view": "ciphertext", "client": c,
              "bytes": 1000} for c in rel.uploads]
    kept.append({"round": 1, "label": STATS_LABEL, "view": "aggregate", "client": None,
                 "file": "agg.safetensors", "clients": len(rel.uploads)})
    (tdir / "index.json").write_text(json.dumps(kept))
    return dest


def test_secure_aggregation_attacks_the_federation_statistics(ccvr_view, tmp_path):
    view = load_run(secagg_copy(ccvr_view, tmp_path / "sa"), exp=ccvr_view.truth_exp)
    plan = plan_stats(view, StatsOptions(raw_samples=0), clients=[0])
    assert any("secure aggregation" in n and "client(s) 0 only" in n for n in plan.notes)
    totals, own = ccvr_view.truth_exp.counts.sum(0), ccvr_view.truth_exp.counts[0]
    # the aggregate is attacked for the classes client 0 holds, and scored on ITS images
    assert [j.base["class"] for j in plan.jobs if j.base["target"] == "class-mean"] == \
        [c for c in range(10) if own[c] > 0]
    for j in plan.jobs:
        assert j.base["client"] == 0 and j.base["view"] == "aggregate"
        assert j.base["n"] == totals[j.base["class"]]
        assert j.base["n_true"] == own[j.base["class"]]
        if j.base["target"] == "class-mean":
            z = true_features(view, None, j.base["class"])
            np.testing.assert_allclose(j.target.mean.numpy(), z.mean(0), rtol=1e-5, atol=1e-5)
    records, notes = infer_class_sets(view, TINY)
    assert len(records) == 1 and records[0]["client"] is None and records[0]["accuracy"] == 1
    assert notes and "hides per-client class sets" in notes[0]


def test_aggregate_reconstruction_gets_no_best_of_federation_credit(ccvr_view, tmp_path):
    """A reconstruction of the aggregate is scored against the attacked client's images only
    (as the per-client row is), so an exact copy of ANOTHER client's image is not a hit."""
    view = load_run(secagg_copy(ccvr_view, tmp_path / "sa"), exp=ccvr_view.truth_exp)
    counts = ccvr_view.truth_exp.counts
    cls = next(c for c in range(10) if counts[0][c] > 0 and counts[1][c] > 0)
    plan = plan_stats(view, TINY, clients=[0], classes=[cls])
    mean_job = next(j for j in plan.jobs if j.base["target"] == "class-mean")
    rec = mean_job.run().record
    assert rec["candidates"] == counts[0][cls] < counts[:, cls].sum()
    other = view.truth(1, cls)[:1]  # an exact copy of a client-1 image of the class
    own = view.truth(0, cls)
    scored, _ = score(view, view.pixels(other), own, paired=False)
    best_own = max(10 * np.log10(1 / float(((view.pixels(other)[0] - t) ** 2).mean()))
                   for t in view.pixels(own))
    assert scored["psnr_best"] == pytest.approx(best_own, abs=1e-3) and math.isfinite(best_own)
    assert scored["nearest_of_best"] is False  # its nearest image is client 1's, not 0's
    federation, _ = score(view, view.pixels(other), view.truth(None, cls), paired=False)
    assert federation["psnr_best"] == math.inf  # what best-of-federation would have credited


def test_prior_is_scored_by_the_same_rule(ccvr_view):
    """One image for a set: both the reconstruction and the prior get their best match."""
    view = ccvr_view
    view.load_state(view.release(STATS_LABEL, None).state)
    cls = int(np.flatnonzero(view.truth_exp.counts[0])[0])
    idx = view.truth(0, cls)
    d = view.truth_exp.data
    prior = d.denormalize(d.x_test[d.y_test == cls].mean(0)).clamp(0, 1)
    best_prior = max(10 * np.log10(1 / float(((prior - t) ** 2).mean())) for t in view.pixels(idx))
    rec, _ = score(view, view.pixels(idx[:1]) * 0.5, idx, paired=False)
    assert rec["matching"] == "best"
    assert rec["prior_psnr"] == pytest.approx(best_prior, abs=1e-3)
    assert rec["prior_psnr_best"] == pytest.approx(best_prior, abs=1e-3)


def test_class_gradients_and_update(creff_view):
    rel = creff_view.release(GRAD_LABEL, None)
    assert rel.round == 2
    opts = UpdatesOptions(steps=5, restarts=1, update_batch=1)
    recorded = plan_model_updates(creff_view, opts, clients=[0])
    (up,) = [j for j in recorded.jobs if j.base["target"] == "model-update"]
    assert up.base["view"] == "plain-upload" and up.base["round"] == 2
    assert up.base["n"] == int(creff_view.truth_exp.counts[0].sum())  # the weight FedAvg used
    # a transcript without recorded updates: one simulated SGD step instead
    import dataclasses

    older = dataclasses.replace(creff_view, entries=[
        e for e in creff_view.entries if e["label"] not in ("model-update", "round")])
    plan = plan_gradients(older, TINY_GRAD, clients=[0])
    updates = plan_model_updates(older, opts, clients=[0])
    plan.jobs += updates.jobs
    plan.notes += updates.notes
    assert any("records no model updates" in n for n in plan.notes)
    grads = [j for j in plan.jobs if j.base["target"] == "class-gradient"]
    assert [j.base["class"] for j in grads] == \
        [c for c in range(10) if creff_view.truth_exp.counts[0][c] > 0]
    for j in grads:
        assert torch.equal(j.target, rel.uploads[0]["grad"][j.base["class"]])
    results = execute(plan)
    for r in [r for r in results if r.record["target"] == "class-gradient"]:
        # the bias gradient of class c's block is negative only at c
        assert r.record["label_correct"] and r.record["recovered_label"] == r.record["class"]
    update = results[-1].record
    assert update["target"] == "model-update" and update["n"] == 1
    assert update["recovered_labels"] == update["labels"]  # exact for one sample (iDLG)


def test_uploaded_features_apply_tukey_then_clip(ccvr_view):
    wrapped = UploadedFeatures(ccvr_view.model, 0.5, 1.0)
    x = ccvr_view.truth_exp.data.x_train[:5]
    with torch.no_grad():
        z = torch.relu(ccvr_view.model.features(x)).sqrt()
        expected = z / np.maximum(1.0, z.norm(dim=1, keepdim=True))
        np.testing.assert_allclose(wrapped.features(x).numpy(), expected.numpy(), rtol=1e-5)


def test_user_errors(ccvr_view, tmp_path):
    with pytest.raises(UsageError, match="uploaded nothing"):
        plan_stats(ccvr_view, TINY, clients=[7])
    with pytest.raises(UsageError, match="out of range"):
        plan_stats(ccvr_view, TINY, clients=[0], classes=[12])
    with pytest.raises(UsageError, match="not a run folder"):
        load_run(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no transcript"):
        load_run(tmp_path)
    with pytest.raises(UsageError, match="steps"):
        StatsOptions(steps=-1)


def test_creff_head_is_recorded_with_every_release(creff_view):
    """The head in every release reproduces the client's upload from its own features
    (per_sample_head_grads, computed independently here), so rank-n recovery runs in
    every round; a transcript without it falls back to the first release's sent head."""
    import dataclasses

    from privfedcal.attacks.reconstruction.gradients_attack import creff_head
    from privfedcal.calibration.creff import per_sample_head_grads
    from privfedcal.calibration.retrain import read_head

    rels = creff_view.releases(GRAD_LABEL)
    assert [r.round for r in rels] == [1, 2]
    d = creff_view.truth_exp.data
    for rel in rels:
        assert set(rel.task) == {"head.weight", "head.bias"}
        assert set(rel.state) == set(creff_view.model.state_dict())  # the state loads alone
        w, b = creff_head(creff_view, rel)
        creff_view.load_state(rel.state)
        idx = creff_view.truth_exp.parts[0]
        with torch.no_grad():
            z = creff_view.model.features(d.x_train[idx]).double()
        g = per_sample_head_grads(z, d.y_train[idx], w, b)
        for c in torch.unique(d.y_train[idx]).tolist():
            mean = g[d.y_train[idx] == c].mean(0)
            assert torch.allclose(rel.uploads[0]["grad"][c].double(), mean, atol=1e-5)
    assert not torch.equal(rels[0].task["head.weight"], rels[1].task["head.weight"])
    plan = plan_gradients(creff_view, TINY_GRAD, clients=[0])
    assert not any("not in the transcript" in n for n in plan.notes)

    def with_head(kind):
        params = {**creff_view.cfg.calibration_params, "initial_head": kind}
        return dataclasses.replace(creff_view, cfg=creff_view.cfg.replace(
            calibration_params=params))

    first, second = (dataclasses.replace(r, task={}) for r in rels)  # an older transcript
    w, b = creff_head(with_head("global"), first)
    head = read_head(first.state)
    assert torch.equal(w, head.weight.double()) and torch.equal(b, head.bias.double())
    assert creff_head(with_head("global"), second) is None
    assert creff_head(with_head("fresh"), first) is None  # a fresh head is the server's own


def test_class_gradients_across_rounds_job(creff_view):
    """One job per attacked (client, class) combines both releases; it records the rounds,
    what it needed and its convergence; ``rounds_combined=1`` plans none."""
    import dataclasses

    opts = dataclasses.replace(TINY_GRAD, rounds_combined=2)
    counts = creff_view.truth_exp.counts[0]
    # n from the gradient's rank (client weighting uploads no count): a class of < C - 1
    small = [c for c in range(10) if 1 <= int(counts[c]) < 9]
    large = [c for c in range(10) if int(counts[c]) >= 9]
    assert small and large, "the fixed-seed partition has both kinds of class"
    plan = plan_gradients(creff_view, opts, clients=[0], classes=[small[0], large[0]])
    jobs = [j for j in plan.jobs if j.base["target"] == "class-gradient-rounds"]
    (job,) = jobs
    assert job.base["class"] == small[0] and job.base["n_used"] == int(counts[small[0]])
    assert any(f"class {large[0]}: n unknown" in n for n in plan.notes)
    assert job.base["rounds"] == [1, 2] and job.base["n"] == int(counts[small[0]])
    rels = creff_view.releases(GRAD_LABEL)
    for blk, rel in zip(job.target, rels, strict=True):
        assert torch.equal(blk, rel.uploads[0]["grad"][small[0]])
    (done,) = execute(dataclasses.replace(plan, jobs=[job]))
    rec = done.record
    assert rec["mode"] == "class-gradients-across-rounds" and rec["steps_run"] <= 5
    assert "the model state and head sent in every combined round" in rec["needed"]
    assert {"psnr", "psnr_best", "nearest_is_true"} <= set(rec)
    one = plan_gradients(creff_view, dataclasses.replace(TINY_GRAD, rounds_combined=1),
                         clients=[0], classes=small[:1])
    assert not [j for j in one.jobs if j.base["target"] == "class-gradient-rounds"]


@pytest.mark.parametrize("kind", ["stats", "gradients"])
def test_batched_execute_equals_one_job_at_a_time(ccvr_view, creff_view, kind):
    """``execute`` with the default attack batch gives, job by job and in plan order, the
    records ``attack_batch=1`` (every job alone) gives: same scores and stopping, within
    float32 rounding. Two clients, several kinds of target (raw, mean, stats; analytic,
    rank-n, across rounds), different image counts in one batch."""
    import dataclasses

    view = ccvr_view if kind == "stats" else creff_view
    plan = (plan_stats(view, StatsOptions(steps=120, restarts=2, raw_samples=2))
            if kind == "stats" else
            plan_gradients(view, GradientsOptions(steps=120, restarts=2, rounds_combined=2)))
    assert plan.attack_batch > 1 and len(plan.jobs) >= 4
    assert len({j.base["target"] for j in plan.jobs}) >= 2
    batched = execute(plan)
    alone = execute(dataclasses.replace(plan, shared={}), attack_batch=1)
    for a, b in zip(alone, batched, strict=True):
        ra, rb = a.record, b.record
        assert (ra["target"], ra["client"], ra["class"]) == (rb["target"], rb["client"],
                                                             rb["class"])
        assert (ra["steps_run"], ra["stopped"]) == (rb["steps_run"], rb["stopped"])
        assert rb["psnr"] == pytest.approx(ra["psnr"], abs=1e-3)
        assert rb["feature_error"] == pytest.approx(ra["feature_error"], rel=1e-3, abs=1e-6)
        torch.testing.assert_close(b.recon, a.recon, rtol=0, atol=1e-4)
    with pytest.raises(UsageError, match="attack-batch"):
        StatsOptions(attack_batch=0)


def test_execute_reports_optimisation_steps_up_to_the_total(ccvr_view):
    """Progress counts restart-steps, never goes back, and ends at its total: the planned
    steps x restarts of every inversion (none stops early in 7 steps: no check before
    the 100th), with every target done and an ETA once steps ran."""
    opts = StatsOptions(steps=7, restarts=2, raw_samples=1)
    plan = plan_stats(ccvr_view, opts, clients=[0])
    seen = []
    execute(plan, on_progress=seen.append)
    planned = 7 * 2 * len(plan.jobs)  # no aggregate: one inversion per job
    assert seen[-1].steps == seen[-1].total == planned
    assert (seen[-1].targets, seen[-1].of) == (len(plan.jobs), len(plan.jobs))
    assert [p.steps for p in seen] == sorted(p.steps for p in seen)
    assert all(p.total == planned for p in seen[1:])
    assert any(0 < p.steps < planned for p in seen)  # counted within the batch, not per target
    assert seen[-1].eta == 0 and all(p.eta is not None for p in seen if p.steps)


def test_interrupted_execute_keeps_finished_targets_and_resumes(ccvr_view):
    """A KeyboardInterrupt after the first batch raises ``Stopped`` with that batch's
    targets; ``done=`` runs only the others, and the results are those of one run."""
    from privfedcal.attacks.reconstruction.runner import Stopped

    opts = StatsOptions(steps=7, restarts=1, raw_samples=1, attack_batch=2)
    plan = plan_stats(ccvr_view, opts, clients=[0])
    whole = execute(plan)

    def stop_after_one(p):
        if p.targets >= 1:
            raise KeyboardInterrupt

    with pytest.raises(Stopped) as stop:
        execute(plan, on_progress=stop_after_one)
    kept = stop.value.finished
    assert 1 <= len(kept) <= 2 < len(plan.jobs) and stop.value.of == len(plan.jobs)
    seen = []
    resumed = execute(plan, on_progress=seen.append, done=kept)
    assert seen[0].targets == len(kept) and seen[-1].total == 7 * (len(plan.jobs) - len(kept))
    for i, (a, b) in enumerate(zip(whole, resumed, strict=True)):
        if i in kept:
            assert b is kept[i]
        # other batches than in the whole run: the same results within float32 rounding
        assert (b.record["target"], b.record["class"], b.record["steps_run"]) == (
            a.record["target"], a.record["class"], a.record["steps_run"])
        assert b.record["psnr"] == pytest.approx(a.record["psnr"], abs=1e-3)
        torch.testing.assert_close(b.recon, a.recon, rtol=0, atol=1e-4)
