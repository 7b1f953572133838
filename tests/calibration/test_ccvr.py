"""CCVR: virtual-feature sampling, the client task, and calibration of a biased head."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from privfedcal.calibration.ccvr import (
    CCVR,
    CCVRParams,
    StatsTask,
    sample_virtual_features,
    virtual_counts,
)
from privfedcal.calibration.oracle import Oracle, OracleParams
from privfedcal.calibration.stats import ClassStats
from privfedcal.calibration.transforms import relu_tukey

torch.set_num_threads(1)


def stats_from_moments(counts, means, covs) -> ClassStats:
    """count N, sum N mu, outer (N-1) Sigma + N mu mu^T (the inverse of mean()/covariance())."""
    n = torch.tensor(counts, dtype=torch.float64)
    mu = torch.tensor(means, dtype=torch.float64)
    sigma = torch.tensor(np.array(covs), dtype=torch.float64)
    outer = (n - 1).clamp_min(0)[:, None, None] * sigma + n[:, None, None] * mu[:, :, None] * mu[:, None, :]
    return ClassStats(n, n[:, None] * mu, outer)


def test_samples_reproduce_mean_and_covariance():
    sigma = np.array([[2.0, 0.8, 0.0], [0.8, 1.0, -0.3], [0.0, -0.3, 0.5]])
    stats = stats_from_moments([50, 40], [[1.0, -2.0, 3.0], [0.0, 5.0, 0.0]], [sigma, np.eye(3)])
    z, y = sample_virtual_features(stats, torch.tensor([20000, 10]),
                                   torch.Generator().manual_seed(0), dtype=torch.float64)
    assert z.shape == (20010, 3) and y.tolist().count(0) == 20000
    z0 = z[y == 0].numpy()
    np.testing.assert_allclose(z0.mean(0), [1.0, -2.0, 3.0], atol=0.05)
    np.testing.assert_allclose(np.cov(z0, rowvar=False), sigma, atol=0.06)


def test_non_psd_and_tiny_classes_never_give_nan():
    bad = np.diag([1.0, -0.5, 2.0])                                   # not a covariance
    stats = stats_from_moments([30, 1, 0], [[0.0, 0.0, 0.0], [7.0, 8.0, 9.0], [0, 0, 0]],
                               [bad, np.zeros((3, 3)), np.zeros((3, 3))])
    z, y = sample_virtual_features(stats, torch.tensor([4000, 5, 5]), torch.Generator().manual_seed(1))
    assert torch.isfinite(z).all()
    assert y.tolist().count(2) == 0                                   # absent: no features
    assert torch.equal(z[y == 1], torch.tensor([[7.0, 8.0, 9.0]]).repeat(5, 1))  # count 1: mean
    var = z[y == 0].double().var(0)
    assert var[1] < 1e-4 and abs(float(var[0]) - 1) < 0.1 and abs(float(var[2]) - 2) < 0.2


def test_sampling_is_deterministic_for_the_generator():
    stats = stats_from_moments([10], [[1.0, 2.0]], [np.eye(2)])
    a = sample_virtual_features(stats, torch.tensor([5]), torch.Generator().manual_seed(3))[0]
    b = sample_virtual_features(stats, torch.tensor([5]), torch.Generator().manual_seed(3))[0]
    c = sample_virtual_features(stats, torch.tensor([5]), torch.Generator().manual_seed(4))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_virtual_counts():
    count = torch.tensor([50.0, 30.0, 20.0, 0.0])
    assert virtual_counts(count, 7).tolist() == [7, 7, 7, 0]
    assert virtual_counts(count, 10, "proportional").tolist() == [20, 12, 8, 0]
    # 4 features over three equal classes: 4/3 each, the spare one to the lowest index
    assert virtual_counts(torch.tensor([1.0, 1.0, 1.0, 0.0]), 1, "proportional").tolist() == [2, 1, 1, 0]
    assert virtual_counts(torch.zeros(3), 5, "proportional").tolist() == [0, 0, 0]


def test_stats_task_transforms_then_clips(helpers):
    model = helpers.TinyModel(3, 2).eval()
    x = torch.randn(9, 3, generator=torch.Generator().manual_seed(0)) * 4
    y = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0])
    bound = helpers.NormBound(1.5)
    payload = StatsTask(2, tukey=True, batch_size=4).compute(model, x, y, bound)
    z = relu_tukey(x)
    z = z * (1.5 / z.norm(dim=1)).clamp(max=1)[:, None]
    ref = ClassStats.from_features(z, y, 2).to_payload()
    assert bound.kinds == ["feature"]
    for key in ref:
        torch.testing.assert_close(payload[key], ref[key])


def test_ccvr_fixes_a_biased_classifier(make_context):
    ctx = make_context()
    ccvr = CCVR(CCVRParams(virtual_per_class=200), num_classes=3, feature_dim=4)
    assert ccvr.eval_state(ctx.global_state) is ctx.global_state
    out = ccvr.after_training(ctx)
    json.dumps(out)                                       # summary fields are JSON
    assert ctx.labels == ["ccvr-stats"]
    assert out["accuracy_before_calibration"] < 0.6
    assert out["calibration"]["accuracy_after"] > 0.9
    assert out["calibration"]["virtual_features"] == 600
    after = ctx.evaluate(ccvr.eval_state(ctx.global_state))
    assert after["accuracy"] == out["calibration"]["accuracy_after"]
    # the extractor is untouched; only the head changed
    state = ccvr.eval_state(ctx.global_state)
    assert torch.equal(state["extractor.weight"], ctx.global_state["extractor.weight"])
    assert not torch.equal(state["classifier.bias"], ctx.global_state["classifier.bias"])

    # resume: a fresh CCVR loaded from the state dict returns the same calibrated model
    again = CCVR(CCVRParams(virtual_per_class=200), num_classes=3, feature_dim=4)
    again.load_state_dict(ccvr.state_dict())
    for k, v in again.eval_state(ctx.global_state).items():
        assert torch.equal(v, state[k])


def test_ccvr_tukey_and_proportional(make_context):
    ctx = make_context(seed=3)
    ccvr = CCVR(CCVRParams(virtual_per_class=100, tukey=True, virtual_mode="proportional"),
                num_classes=3, feature_dim=4)
    assert ccvr.feature_transform() is None                 # not before calibration
    out = ccvr.after_training(ctx)
    assert ccvr.feature_transform() is not None
    assert out["calibration"]["virtual_features"] == 300
    assert out["calibration"]["accuracy_after"] > out["accuracy_before_calibration"] + 0.2


def test_ccvr_with_clsnorm_head(make_context):
    ctx = make_context(normalized=True)
    assert "classifier.parametrizations.weight.original" in ctx.global_state
    ccvr = CCVR(CCVRParams(virtual_per_class=200), num_classes=3, feature_dim=4)
    out = ccvr.after_training(ctx)
    state = ccvr.eval_state(ctx.global_state)
    assert set(state) == set(ctx.global_state)
    assert out["calibration"]["accuracy_after"] > 0.9 > 0.6 > out["accuracy_before_calibration"]
    # a clsnorm head stays bias-free: exactly the stored zero, nothing trained or stored
    assert torch.equal(state["classifier.bias"], torch.zeros(3))
    assert "bias" not in ccvr.state_dict()


def test_oracle_uses_real_features(make_context):
    ctx = make_context()
    oracle = Oracle(OracleParams(per_class=20), num_classes=3, feature_dim=4)
    out = oracle.after_training(ctx)
    assert out["calibration"]["real_features"] == 60
    assert out["calibration"]["accuracy_after"] > 0.9
    full = Oracle(num_classes=3, feature_dim=4).after_training(make_context())
    assert full["calibration"]["real_features"] == sum(len(c[1]) for c in ctx.clients)


@pytest.mark.parametrize("tukey", [False, True])
def test_a_ccvr_run_evaluates_the_test_set_twice(tiny_cfg, tmp_path, monkeypatch, tukey):
    """The final round's evaluation serves as CCVR's "before", and the summary reuses the
    calibrated evaluation: two test passes in a run, where three were made before."""
    import privfedcal.federation.simulator as simulator
    from privfedcal.experiment import build_simulator

    calls: list[int] = []
    real = simulator.evaluate

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(simulator, "evaluate", counting)
    cfg = tiny_cfg(calibrate="ccvr", rounds=2, eval_every=10**6,
                   calibration_params={"tukey": True} if tukey else {})
    summary = build_simulator(cfg, tmp_path / "run").run()
    assert len(calls) == 2
    assert summary["accuracy"] == summary["calibration"]["accuracy_after"]
