"""ClassStats: additive merge == pooled numpy mean / unbiased covariance == paper's Eq. 3-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.calibration.stats import ClassStats, merge_client_moments
from privfedcal.errors import UploadRejected

torch.set_num_threads(1)


@st.composite
def split_features(draw):
    """A feature set with labels, split over clients (some get one sample of a class, some
    none of it), plus the number of classes (some classes may be absent everywhere)."""
    num_classes = draw(st.integers(1, 4))
    dim = draw(st.integers(1, 4))
    n = draw(st.integers(1, 24))
    clients = draw(st.integers(1, 4))
    labels = draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n))
    owner = draw(st.lists(st.integers(0, clients - 1), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, dim)) * rng.uniform(0.1, 5.0) + rng.normal(size=dim) * 3
    return z, np.array(labels), np.array(owner), clients, num_classes


def numpy_reference(z, y, num_classes):
    d = z.shape[1]
    counts = np.bincount(y, minlength=num_classes).astype(float)
    means = np.zeros((num_classes, d))
    covs = np.zeros((num_classes, d, d))
    for c in range(num_classes):
        zc = z[y == c]
        if len(zc) >= 1:
            means[c] = zc.mean(0)
        if len(zc) >= 2:
            covs[c] = np.cov(zc, rowvar=False, ddof=1).reshape(d, d)
    return counts, means, covs


@settings(max_examples=60, deadline=None)
@given(split_features())
def test_merge_of_any_split_equals_pooled_numpy_and_eq34(case):
    z, y, owner, clients, num_classes = case
    d = z.shape[1]
    parts = [ClassStats.from_features(torch.from_numpy(z[owner == k]),
                                      torch.from_numpy(y[owner == k]), num_classes)
             for k in range(clients)]
    merged = sum(parts, ClassStats.zeros(num_classes, d))
    counts, means, covs = numpy_reference(z, y, num_classes)
    np.testing.assert_array_equal(merged.count.numpy(), counts)
    np.testing.assert_allclose(merged.mean().numpy(), means, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(merged.covariance().numpy(), covs, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(merged.present.numpy(), counts > 0)

    # the paper's form, from per-client (N_ck, mu_ck, Sigma_ck) computed by numpy
    per_client = [numpy_reference(z[owner == k], y[owner == k], num_classes) for k in range(clients)]
    n_c, mu_c, sigma_c = merge_client_moments(*(torch.from_numpy(np.stack(a)) for a in zip(*per_client, strict=True)))
    np.testing.assert_allclose(n_c.numpy(), counts)
    np.testing.assert_allclose(mu_c.numpy(), means, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(sigma_c.numpy(), covs, rtol=1e-9, atol=1e-9)


def test_from_features_sums_in_float64():
    z = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]], dtype=torch.float32)
    y = torch.tensor([1, 1, 0])
    s = ClassStats.from_features(z, y, 3)
    assert s.count.dtype == s.sum.dtype == s.outer.dtype == torch.float64
    np.testing.assert_array_equal(s.count.numpy(), [1, 2, 0])
    np.testing.assert_allclose(s.sum.numpy(), [[0.5, 0.5], [4, 1], [0, 0]])
    # class 1: [1,2][1,2]^T + [3,-1][3,-1]^T = [[10, -1], [-1, 5]]
    np.testing.assert_allclose(s.outer[1].numpy(), [[10, -1], [-1, 5]])
    np.testing.assert_allclose(s.outer[0].numpy(), [[0.25, 0.25], [0.25, 0.25]])
    # count 1 -> zero covariance, count 0 -> zero mean and covariance; no NaN anywhere
    assert torch.equal(s.covariance()[0], torch.zeros(2, 2))
    assert torch.equal(s.covariance()[2], torch.zeros(2, 2))
    assert torch.equal(s.mean()[2], torch.zeros(2))
    # class 1: mean (2, 0.5); unbiased cov = ([[10,-1],[-1,5]] - 2 mu mu^T) / 1
    np.testing.assert_allclose(s.covariance()[1].numpy(), [[2, -3], [-3, 4.5]])


def test_payload_round_trip_and_validation():
    s = ClassStats.from_features(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)),
                                 torch.tensor([0, 1, 1, 0, 1]), 2)
    back = ClassStats.from_payload(s.to_payload(), num_classes=2, dim=3)
    for a, b in zip(s.to_payload().values(), back.to_payload().values(), strict=True):
        assert torch.equal(a, b)
    good = s.to_payload()
    with pytest.raises(UploadRejected, match="keys"):
        ClassStats.from_payload({"count": good["count"], "sum": good["sum"]})
    with pytest.raises(UploadRejected, match="NaN"):
        ClassStats.from_payload({**good, "sum": good["sum"].clone().fill_(float("nan"))})
    with pytest.raises(UploadRejected, match="shapes"):
        ClassStats.from_payload({**good, "outer": good["outer"][:, :2]})
    with pytest.raises(UploadRejected, match="expected 3"):
        ClassStats.from_payload(good, num_classes=3)
    with pytest.raises(UploadRejected, match="dim"):
        ClassStats.from_payload(good, dim=4)


def test_merge_shape_mismatch_raises():
    with pytest.raises(ValueError, match="merge"):
        ClassStats.zeros(2, 3) + ClassStats.zeros(2, 4)
    with pytest.raises(ValueError, match="shapes"):
        ClassStats(torch.zeros(2), torch.zeros(3, 4), torch.zeros(3, 4, 4))


def test_noisy_counts_follow_the_documented_rules():
    # a DP-noised aggregate: count 0.3 -> absent, 1.4 -> present without covariance
    s = ClassStats(torch.tensor([0.3, 1.4, 3.0]), torch.ones(3, 2), torch.eye(2).repeat(3, 1, 1))
    assert s.present.tolist() == [False, True, True]
    assert torch.equal(s.mean()[0], torch.zeros(2, dtype=torch.float64))
    np.testing.assert_allclose(s.mean()[1].numpy(), [1 / 1.4, 1 / 1.4])
    assert torch.equal(s.covariance()[1], torch.zeros(2, 2, dtype=torch.float64))
    # count 3: (I - s s^T / 3) / 2, symmetric
    np.testing.assert_allclose(s.covariance()[2].numpy(),
                               (np.eye(2) - np.ones((2, 2)) / 3) / 2)
