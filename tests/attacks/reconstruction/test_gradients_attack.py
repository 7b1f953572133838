"""The attack on CReFF's class gradients as its file declares it: registered under the
name the calibrator's release names, the audit's client task carries the run's options and
the initial head, and ``keep`` is exactly the entries a canary feature moves under sample
weighting (the audit drops the rest). (The planner's targets, rank-n and across-rounds jobs
are tested end to end in test_runner.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from privfedcal.attacks.distinguishing.channels import FeatureMap
from privfedcal.attacks.reconstruction import gradients_attack
from privfedcal.attacks.reconstruction.gradients_attack import GradientsOptions
from privfedcal.attacks.release_attacks import release_attack, release_for
from privfedcal.calibration.creff import CREFF_RELEASE, CReFF, CReFFParams, GradTask
from privfedcal.privacy.bound import NoBound


def test_targets_the_release_creff_declares():
    assert release_for("gradients").label == CREFF_RELEASE
    (spec,) = CReFF.releases
    attack = release_attack("gradients")
    assert attack.plan is gradients_attack.plan_gradients and attack.clip == "class-gradient"
    assert set(attack.canary_keys) <= set(spec.keys)


def test_task_has_the_run_options_and_the_initial_head():
    head = torch.nn.Linear(3, 4)
    params = CReFFParams(weighting="sample", feature_batch_size=32, client_draws=2, draw_size=5)
    cal = CReFF(params, num_classes=4, feature_dim=3)
    data = type("D", (), {"num_classes": 4})()
    exp = type("Exp", (), {"data": data, "model": type("M", (), {"classifier": head})()})()
    cfg = SimpleNamespace(training=SimpleNamespace(seed=9))
    task = gradients_attack.task(cfg, exp, cal)
    assert torch.equal(task.weight, head.weight.detach().double())
    assert torch.equal(task.bias, head.bias.detach().double())
    assert (task.num_classes, task.weighting, task.batch_size, task.per_class_cap,
            task.seed) == (4, "sample", 32, 10, 9)


def test_keep_is_exactly_what_a_canary_moves():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(30, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (30,), generator=g)
    w, b = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    task, model, c = GradTask(w, b, 4, weighting="sample"), FeatureMap(5), 1
    canary = torch.zeros(1, 5, dtype=torch.float64)
    canary[0, 0] = 7.0
    clean = task.compute(model, z, y, NoBound())
    plus = task.compute(model, torch.cat([z, canary]), torch.cat([y, torch.tensor([c])]),
                        NoBound())
    for key in clean:
        moved = (plus[key] - clean[key]).abs() > 1e-12
        kept = torch.zeros_like(moved)
        kept[gradients_attack.keep(key, c)] = True
        assert torch.equal(moved, kept), key


@pytest.fixture(scope="module")
def dsa_view(tmp_path_factory):
    """A CReFF run with the default augmentation (DSA) whose partition gives some client
    classes of one sample (digits, 5 clients, alpha 0.3, seed 0: the quick attack run's)."""
    from privfedcal.attacks.reconstruction.runner import load_run
    from privfedcal.cli.main import main

    run = tmp_path_factory.mktemp("dsa") / "creff"
    main(["train", "--dataset", "digits", "--clients", "5", "--alpha", "0.3", "--rounds", "1",
          "--local-epochs", "1", "--device", "cpu", "--threads", "1", "--seed", "0",
          "--method", "creff", "--match-steps", "5", "--retrain-steps", "5", "--out", str(run)])
    return load_run(run)


def test_one_sample_recovery_is_exact_for_the_image_the_client_augmented(dsa_view):
    """Under DSA a one-sample class gradient is ``(p - e_y) [z, 1]`` of the AUGMENTED image's
    feature z: the upload is reproduced from the recomputed augmented image (which pins the
    round's task seed), ``dW_j / db_j`` recovers that feature exactly, while the original
    image's feature is not what the client sent (why scoring against it fell to 0.997)."""
    import torch.nn.functional as F

    from privfedcal.attacks.reconstruction.gradient_inversion import (
        recover_from_class_gradient,
        split_class_gradient,
    )
    from privfedcal.calibration.creff import per_sample_head_grads

    view = dsa_view
    rel = view.release(CREFF_RELEASE, None)
    inputs = gradients_attack.differentiated_inputs(view, rel)
    assert inputs is not None
    w, b = gradients_attack.creff_head(view, rel)
    d = view.truth_exp.data
    singles = [(k, c) for k in sorted(rel.uploads) for c in range(d.num_classes)
               if view.truth(k, c).numel() == 1]
    assert len(singles) >= 2, "the fixed-seed partition has classes of one sample"
    view.load_state(rel.state)
    original = []
    for k, c in singles:
        idx = view.truth(k, c)
        with torch.no_grad():
            z_aug = view.model.features(inputs(idx)).double()
            z_orig = view.model.features(d.x_train[idx]).double()
        upload = rel.uploads[k]["grad"][c].double()
        assert torch.allclose(per_sample_head_grads(z_aug, d.y_train[idx], w, b)[0], upload,
                              atol=1e-5)
        z, info = recover_from_class_gradient(*split_class_gradient(upload))
        assert bool(info.single_sample) and int(info.label) == c
        assert gradients_attack.recovered_cosine(view, z[None], idx, inputs) > 0.9999
        original.append(float(F.cosine_similarity(z, z_orig[0], dim=0)))
    assert min(original) < 0.9999, original  # the augmentation moved some feature


def test_records_score_the_features_the_clients_differentiated(dsa_view):
    """The planner's one-sample jobs record ``recovered_cosine`` > 0.9999 (the analytic
    recovery against the augmented image's feature) and ``feature_cosine`` against the
    same features, not the original images'."""
    from privfedcal.attacks.reconstruction.metrics import feature_cosine
    from privfedcal.attacks.reconstruction.runner import execute

    view = dsa_view
    rel = view.release(CREFF_RELEASE, None)
    inputs = gradients_attack.differentiated_inputs(view, rel)
    plan = gradients_attack.plan_gradients(
        view, GradientsOptions(steps=5, restarts=1, rounds_combined=1),
        clients=sorted(rel.uploads))
    singles = [i for i, j in enumerate(plan.jobs) if j.base["n_true"] == 1]
    assert singles
    plan.jobs = [plan.jobs[i] for i in singles]
    d = view.truth_exp.data
    for job, res in zip(plan.jobs, execute(plan), strict=True):
        rec = res.record
        assert rec["recovered_cosine"] > 0.9999, rec
        assert "augmented" in rec["features_of"]
        idx = view.truth(job.base["client"], job.base["class"])
        view.load_state(rel.state)
        with torch.no_grad():
            want = feature_cosine(view.model, res.recon, view.model.features(inputs(idx)),
                                  mean=d.mean, std=d.std)
        assert rec["feature_cosine"] == pytest.approx(float(want.mean()), abs=1e-6)
