"""Feature targets: statistics pin features down (features_from_stats against numpy), and
how each target is posed to the optimiser."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.attacks.reconstruction.feature_targets import (
    FeatureTarget,
    features_from_stats,
    pose,
    shape_of,
)


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


def test_features_from_stats_n2_exact_against_numpy():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2, 6))
    mu, sigma = z.mean(0), np.cov(z, rowvar=False)  # unbiased, ddof = 1
    rec = features_from_stats(2, torch.tensor(mu), torch.tensor(sigma)).numpy()
    if np.abs(rec - z).max() > np.abs(rec[::-1] - z).max():
        rec = rec[::-1]
    assert np.abs(rec - z).max() < 1e-6


def test_features_from_stats_n1_is_the_mean():
    mu = torch.randn(4, generator=_gen())
    assert torch.equal(features_from_stats(1, mu, torch.zeros(4, 4)), mu[None])


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 7), st.integers(2, 8), st.integers(0, 10_000))
def test_features_from_stats_reproduce_mean_and_covariance(n, d, seed):
    # For n > 2 the features are only known up to rotation, but any valid reconstruction
    # must have exactly the uploaded mean and unbiased covariance (rank <= n - 1).
    z = np.random.default_rng(seed).normal(size=(n, d))
    mu, sigma = z.mean(0), np.cov(z, rowvar=False)
    rec = features_from_stats(n, torch.tensor(mu), torch.tensor(sigma)).numpy()
    assert rec.shape == (n, d)
    assert np.allclose(rec.mean(0), mu, atol=1e-9)
    assert np.allclose(np.cov(rec, rowvar=False), sigma, atol=1e-8)


def test_each_target_is_posed_as_its_kind_says():
    cpu, f32 = torch.device("cpu"), torch.float32
    mu, cov = torch.ones(4), torch.eye(4)
    cases = [
        (FeatureTarget.raw(torch.ones(3, 4)), "raw-feature", "per-image", 3),
        (FeatureTarget.class_mean(mu, 5), "class-mean", "per-image", 1),
        (FeatureTarget.class_mean(mu, 5, batch=True), "class-mean-batch", "mean", 5),
        (FeatureTarget.class_stats(2, mu, cov), "class-stats-features", "per-image", 2),
        (FeatureTarget.class_stats(5, mu, cov), "class-stats-direct", "stats", 5),
        (FeatureTarget.class_stats(5, mu, cov, mode="features"), "class-stats-features",
         "per-image", 5),
    ]
    for target, mode, term, batch in cases:
        p = pose(target, cpu, f32)
        assert (p.mode, p.term, p.batch) == (mode, term, batch)
        assert shape_of(target) == (term, batch)
