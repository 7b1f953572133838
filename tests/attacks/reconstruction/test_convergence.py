"""Converged-by-default inversion, eval-mode scoring, worst-case aggregation and the
analytic rank-n recovery of features from one class gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from privfedcal.attacks.reconstruction.feature_inversion import (
    DEFAULT_MAX_STEPS,
    FeatureTarget,
    InversionConfig,
    invert_features,
)
from privfedcal.attacks.reconstruction.gradient_inversion import gradient_rank, recover_rank_n
from privfedcal.attacks.reconstruction.metrics import feature_cosine
from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.attacks.reconstruction.scoring import worst_case
from privfedcal.errors import UsageError

MEAN, STD = [0.5], [0.25]  # as in conftest.py


def test_default_cap_is_breaching_scale():
    assert DEFAULT_MAX_STEPS >= 24_000 and InversionConfig().steps == DEFAULT_MAX_STEPS
    with pytest.raises(UsageError):
        InversionConfig(check_every=0)


def test_criterion_stops_early_on_an_easy_target(linear_model, images):
    """An injective linear extractor and no priors: the feature error reaches tol long
    before the cap, and the image is recovered."""
    with torch.no_grad():
        z = linear_model.features((images - 0.5) / 0.25)
    cap = 20_000
    res = invert_features(linear_model, FeatureTarget.raw(z), image_shape=(1, 4, 4), mean=MEAN,
                          std=STD, generator=torch.Generator().manual_seed(0), steps=cap,
                          restarts=1, tv_weight=0.0, l2_weight=0.0,
                          config=InversionConfig(tol=1e-4, check_every=50))
    conv = res.convergence
    assert conv.stopped == "converged" and conv.steps < cap / 4 and conv.steps % 50 == 0
    assert conv.error <= 1e-4
    rel = (res.features - z).norm(dim=1) / z.norm(dim=1)
    assert float(rel.max()) == pytest.approx(conv.error, rel=1e-3, abs=1e-7)
    assert float((res.images - images).abs().max()) < 1e-3
    assert conv.as_record()["converged"] is True


def test_unreachable_tolerance_ends_on_a_plateau(linear_model, images):
    """tol = 0 cannot be met: the step size is halved on plateaus until the floor."""
    with torch.no_grad():
        z = linear_model.features((images - 0.5) / 0.25)
    cfg = InversionConfig(tol=0.0, check_every=20, patience=1, min_lr_ratio=0.1,
                          tv_weight=0.05, restarts=1)
    res = invert_features(linear_model, FeatureTarget.raw(z), image_shape=(1, 4, 4), mean=MEAN,
                          std=STD, generator=torch.Generator().manual_seed(0), steps=20_000,
                          config=cfg)
    assert res.convergence.stopped == "plateau" and res.convergence.steps < 20_000
    short = invert_features(linear_model, FeatureTarget.raw(z), image_shape=(1, 4, 4),
                            mean=MEAN, std=STD, generator=torch.Generator().manual_seed(0),
                            steps=30, config=cfg)
    assert short.convergence.stopped == "cap" and short.convergence.steps == 30


# ---- eval mode --------------------------------------------------------------------------------
def _bn_model(toy):
    model = toy(mlp=True, bn=True)
    with torch.no_grad():
        model.bn.running_mean.fill_(0.3)
        model.bn.running_var.fill_(2.0)
    return model


def test_eval_mode_restores_every_submodule(toy):
    model = _bn_model(toy)
    model.train()
    model.body.eval()  # mixed modes come back as they were
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model.bn.training and not model.body.training
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError("boom")
    assert model.training


def test_scoring_and_inversion_use_running_statistics(toy, images):
    """A BatchNorm model left in train mode: scores equal the eval-mode values and no
    running statistic moves (train mode would normalise by the batch and update them)."""
    model = _bn_model(toy)
    x = (images - 0.5) / 0.25
    model.eval()
    with torch.no_grad():
        z_eval = model.features(x)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fc = feature_cosine(model, images, z_eval, mean=MEAN, std=STD)
    assert torch.allclose(fc, torch.ones(3), atol=1e-6)
    res = invert_features(model, FeatureTarget.raw(z_eval), image_shape=(1, 4, 4), mean=MEAN,
                          std=STD, generator=torch.Generator().manual_seed(0), steps=40,
                          restarts=1)
    assert model.training and model.bn.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model.eval()
    with torch.no_grad():
        z_res = model.features((res.images - 0.5) / 0.25)
    cos = torch.nn.functional.cosine_similarity(z_res, z_eval, dim=-1).mean()
    assert res.cosine == pytest.approx(float(cos), abs=1e-4)


# ---- worst case -------------------------------------------------------------------------------
def test_worst_case_is_the_most_exposed_individual():
    records = [
        {"client": 0, "class": 1, "target": "class-mean", "psnr": 20.0, "psnr_best": 21.0,
         "nearest_of_best": False, "prior_psnr_best": 15.0},
        {"client": 2, "class": 7, "target": "class-stats", "psnr": 18.0, "psnr_best": 40.0,
         "nearest_of_best": True, "prior_psnr_best": 16.0},
        {"client": 1, "class": 3, "target": "class-stats", "psnr": 30.0, "psnr_best": 31.0,
         "nearest_of_best": False, "prior_psnr_best": 17.5},
        {"client": 4, "class": 0, "target": "class-mean", "psnr": None, "psnr_best": math.nan,
         "nearest_of_best": True, "prior_psnr_best": 99.0},  # not scored: ignored
    ]
    w = worst_case(records)
    assert (w["psnr_max"], w["nearest_of_worst"], w["worst_client"], w["worst_class"],
            w["worst_target"], w["prior_psnr_max"]) == (40.0, True, 2, 7, "class-stats", 17.5)
    empty = worst_case([])
    assert math.isnan(empty["psnr_max"]) and empty["worst_client"] is None


# ---- rank-n recovery --------------------------------------------------------------------------
def _class_gradient(z: np.ndarray, w: np.ndarray, b: np.ndarray, label: int) -> np.ndarray:
    """Mean CE gradient w.r.t. [W | b] over the rows of z, all labelled ``label`` (numpy)."""
    logits = z @ w.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[:, label] -= 1
    return p.T @ np.hstack([z, np.ones((len(z), 1))]) / len(z)


@pytest.mark.parametrize("n", [1, 2])
def test_rank_n_recovers_the_features_exactly(n):
    rng = np.random.default_rng(n)
    c, d, label = 5, 6, 2
    w, b = rng.normal(0, 0.5, (c, d)), rng.normal(0, 0.2, c)
    z = np.abs(rng.normal(0, 1, (n, d)))
    grad = torch.from_numpy(_class_gradient(z, w, b, label))
    assert gradient_rank(grad[:, :-1]) == n
    res = recover_rank_n(grad, torch.from_numpy(w), torch.from_numpy(b), label, n,
                         generator=torch.Generator().manual_seed(0))
    got = res.features.numpy()
    cost = ((got[:, None] - z[None]) ** 2).sum(-1)
    rows, cols = linear_sum_assignment(cost)  # order is not identifiable
    np.testing.assert_allclose(got[rows], z[cols], rtol=1e-5, atol=1e-6)
    assert res.residual < 1e-6 and res.rank == n


def test_rank_n_beats_the_weighted_mean_for_two_samples():
    """The least-squares (rank-one) estimate is a weighted mean of the two features: far
    from both; rank-n recovery is exact."""
    from privfedcal.attacks.reconstruction.gradient_inversion import recover_from_class_gradient

    rng = np.random.default_rng(5)
    w, b = rng.normal(0, 0.5, (4, 3)), np.zeros(4)
    z = np.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    grad = torch.from_numpy(_class_gradient(z, w, b, 1))
    mean_est, info = recover_from_class_gradient(grad[:, :-1], grad[:, -1])
    assert float(info.residual) > 1e-3
    assert min(np.linalg.norm(mean_est.numpy() - zi) for zi in z) > 0.1
    res = recover_rank_n(grad, torch.from_numpy(w), torch.from_numpy(b), 1, 2,
                         generator=torch.Generator().manual_seed(0))
    assert max(min(np.linalg.norm(r - zi) for zi in z) for r in res.features.numpy()) < 1e-5
