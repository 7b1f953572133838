"""The attack on CReFF's class gradients as its file declares it: registered under the
name the calibrator's release names, the audit's client task carries the run's options and
the initial head, and ``keep`` is exactly the entries a canary feature moves under sample
weighting (the audit drops the rest). (The planner's targets, rank-n and across-rounds jobs
are tested end to end in test_runner.py.)"""

from __future__ import annotations

import torch

from privfedcal.attacks import gradients_attack
from privfedcal.attacks.dp_channels import FeatureMap
from privfedcal.attacks.release_attacks import release_attack, release_for
from privfedcal.calibration.creff import CREFF_RELEASE, CReFF, CReFFParams, GradTask
from privfedcal.privacy.bound import NoBound


def test_registered_under_the_name_creff_declares():
    assert release_for("gradients").label == CREFF_RELEASE
    (spec,) = CReFF.releases
    attack = release_attack(spec.attack)
    assert attack.plan is gradients_attack.plan_gradients and attack.clip == "class-gradient"
    assert set(attack.canary_keys) <= set(spec.keys)


def test_task_has_the_run_options_and_the_initial_head():
    head = torch.nn.Linear(3, 4)
    params = CReFFParams(weighting="sample", feature_batch_size=32, client_draws=2, draw_size=5)
    cal = CReFF(params, num_classes=4, feature_dim=3)
    data = type("D", (), {"num_classes": 4})()
    exp = type("Exp", (), {"data": data, "model": type("M", (), {"classifier": head})()})()
    cfg = type("Cfg", (), {"seed": 9})()
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
