"""The attack on CCVR's statistics as its file declares it: registered under the name the
calibrator's release names, the client task the privacy audit builds is CCVR's own, and
``keep`` is exactly the entries a canary feature moves (the audit drops the rest).
(The planner's targets and records are tested end to end in test_runner.py.)"""

from __future__ import annotations

import torch

from privfedcal.attacks.distinguishing.channels import FeatureMap
from privfedcal.attacks.reconstruction import stats_attack
from privfedcal.attacks.release_attacks import release_attack, release_for
from privfedcal.calibration.ccvr import CCVR, CCVR_RELEASE, CCVRParams, StatsTask
from privfedcal.privacy.bound import NoBound


def test_targets_the_release_ccvr_declares():
    assert release_for("stats").label == CCVR_RELEASE
    (spec,) = CCVR.releases
    attack = release_attack("stats")
    assert attack.plan is stats_attack.plan_stats and attack.clip == "feature"
    assert set(attack.canary_keys) <= set(spec.keys)


def test_task_is_ccvrs_own_with_the_run_options():
    params = CCVRParams(tukey=True, tukey_lambda=0.3, feature_batch_size=64)
    cal = CCVR(params, num_classes=4, feature_dim=3)
    exp = type("Exp", (), {"data": type("D", (), {"num_classes": 4})()})()
    assert stats_attack.task(None, exp, cal) == StatsTask(4, True, 0.3, 64)


def test_keep_is_exactly_what_a_canary_moves():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(30, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (30,), generator=g)
    task, model, c = StatsTask(4), FeatureMap(5), 2
    canary = torch.zeros(1, 5, dtype=torch.float64)
    canary[0, 0] = 7.0
    clean = task.compute(model, z, y, NoBound())
    plus = task.compute(model, torch.cat([z, canary]), torch.cat([y, torch.tensor([c])]),
                        NoBound())
    for key in clean:
        moved = (plus[key] - clean[key]).abs() > 0
        kept = torch.zeros_like(moved)
        kept[stats_attack.keep(key, c)] = True
        assert torch.equal(moved, kept), key
