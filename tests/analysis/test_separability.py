"""Sliced W2 between Gaussians against sorted samples (exact 1-D W2 coupling) and scipy."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import wasserstein_distance

from privfedcal.analysis import (
    mean_sliced_wasserstein,
    pairwise_sliced_wasserstein,
    random_directions,
    sliced_wasserstein_gaussians,
)
from privfedcal.errors import UsageError

MU1, COV1 = np.array([0.0, 0.0]), np.array([[2.0, 0.6], [0.6, 1.0]])
MU2, COV2 = np.array([1.0, -0.5]), np.array([[0.5, -0.2], [-0.2, 1.5]])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def sorted_w2sq(a: np.ndarray, b: np.ndarray) -> float:
    """Empirical W2^2 of two equal-size 1-D samples: the monotone coupling pairs sorted values."""
    return float(np.mean((np.sort(a) - np.sort(b)) ** 2))


def test_one_dimension_is_plain_w2_and_matches_samples() -> None:
    # d = 1: every direction is +-1, so SW2 = W2 = sqrt((m1 - m2)^2 + (s1 - s2)^2) exactly
    m1, s1, m2, s2 = 0.3, 2.0, -1.2, 0.5
    closed = np.sqrt((m1 - m2) ** 2 + (s1 - s2) ** 2)
    got = sliced_wasserstein_gaussians(t([m1]), t([[s1**2]]), t([m2]), t([[s2**2]]), 3, gen())
    assert got == pytest.approx(closed, rel=1e-12)
    rng = np.random.default_rng(0)
    a, b = rng.normal(m1, s1, 200_000), rng.normal(m2, s2, 200_000)
    assert np.sqrt(sorted_w2sq(a, b)) == pytest.approx(closed, rel=0.01)
    # scipy computes W1, which is <= W2 (Jensen); for equal variances both equal |m1 - m2|
    assert wasserstein_distance(a, b) <= closed
    c = rng.normal(m2, s1, 200_000)
    same_var = sliced_wasserstein_gaussians(t([m1]), t([[s1**2]]), t([m2]), t([[s1**2]]), 3, gen())
    assert same_var == pytest.approx(abs(m1 - m2), rel=1e-12)
    assert wasserstein_distance(a, c) == pytest.approx(same_var, rel=0.02)


def test_two_dimensions_against_sampled_quadrature() -> None:
    # independent SW2: sample both Gaussians, W2^2 by sorting along 60 equally spaced angles
    # on [0, pi) (uniform directions on the circle; trapezoid is exact-ish for periodic f)
    rng = np.random.default_rng(1)
    xa = rng.multivariate_normal(MU1, COV1, 100_000)
    xb = rng.multivariate_normal(MU2, COV2, 100_000)
    angles = np.linspace(0, np.pi, 60, endpoint=False)
    dirs = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    sampled = np.sqrt(np.mean([sorted_w2sq(xa @ u, xb @ u) for u in dirs]))
    # the same quadrature with the closed form per direction
    quad = np.sqrt(
        np.mean(
            [
                (u @ (MU1 - MU2)) ** 2 + (np.sqrt(u @ COV1 @ u) - np.sqrt(u @ COV2 @ u)) ** 2
                for u in dirs
            ]
        )
    )
    assert sampled == pytest.approx(quad, rel=0.01)
    got = sliced_wasserstein_gaussians(t(MU1), t(COV1), t(MU2), t(COV2), 20_000, gen())
    assert got == pytest.approx(quad, rel=0.01)


def test_identical_gaussians_give_zero_and_equal_covs_give_mean_term() -> None:
    assert sliced_wasserstein_gaussians(t(MU1), t(COV1), t(MU1), t(COV1), 50, gen()) == 0.0
    # equal covariances: E_u (u . delta)^2 = ||delta||^2 / d for u uniform on the sphere
    d, delta = 5, np.arange(1.0, 6.0)
    cov = np.eye(d) * 2.0
    got = sliced_wasserstein_gaussians(t(np.zeros(d)), t(cov), t(delta), t(cov), 50_000, gen())
    assert got == pytest.approx(np.linalg.norm(delta) / np.sqrt(d), rel=0.01)


def test_random_directions_are_unit_and_isotropic() -> None:
    u = random_directions(40_000, 3, gen(2))
    torch.testing.assert_close(u.norm(dim=1), torch.ones(40_000, dtype=torch.float64))
    torch.testing.assert_close(
        u.T @ u / 40_000, torch.eye(3, dtype=torch.float64) / 3, atol=0.01, rtol=0
    )
    torch.testing.assert_close(u, random_directions(40_000, 3, gen(2)))


def _psd(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T


@settings(max_examples=20, deadline=None)
@given(
    d=st.integers(1, 6),
    c=st.integers(2, 5),
    scale=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_pairwise_invariants(d: int, c: int, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    means = t(rng.normal(size=(c, d)))
    covs = t(np.stack([_psd(rng, d) for _ in range(c)]))
    mat = pairwise_sliced_wasserstein(means, covs, 64, gen(seed))
    assert mat.shape == (c, c)
    torch.testing.assert_close(mat, mat.T)
    assert torch.all(mat.diagonal() == 0) and torch.all(mat >= 0)
    # same directions: shifting every mean changes nothing, scaling by a scales SW by a
    shift = t(rng.normal(size=d))
    torch.testing.assert_close(
        pairwise_sliced_wasserstein(means + shift, covs, 64, gen(seed)), mat, rtol=1e-9, atol=1e-9
    )
    scaled = pairwise_sliced_wasserstein(means * scale, covs * scale**2, 64, gen(seed))
    torch.testing.assert_close(scaled, mat * scale, rtol=1e-9, atol=1e-12)
    # the mean over class pairs is the mean of the upper triangle
    stats = {k: (means[k], covs[k]) for k in range(c)}
    iu = np.triu_indices(c, 1)
    assert mean_sliced_wasserstein(stats, 64, gen(seed)) == pytest.approx(
        mat.numpy()[iu].mean(), rel=1e-12
    )
    assert mean_sliced_wasserstein(list(stats.values()), 64, gen(seed)) == pytest.approx(
        mat.numpy()[iu].mean(), rel=1e-12
    )


def test_pair_function_agrees_with_matrix() -> None:
    means, covs = t(np.stack([MU1, MU2])), t(np.stack([COV1, COV2]))
    mat = pairwise_sliced_wasserstein(means, covs, 100, gen(5))
    assert sliced_wasserstein_gaussians(
        t(MU1), t(COV1), t(MU2), t(COV2), 100, gen(5)
    ) == pytest.approx(mat[0, 1].item(), rel=1e-12)


@pytest.mark.parametrize(
    "mu2,cov2,n",
    [
        (MU2, np.array([[1.0, 0.0], [0.0, -1.0]]), 10),  # not PSD
        (MU2, np.array([[1.0, 0.5], [0.0, 1.0]]), 10),  # not symmetric
        (np.array([np.nan, 0.0]), COV2, 10),  # a class no client holds
        (np.zeros(3), np.eye(3), 10),  # dimension mismatch
        (MU2, COV2, 0),  # no projections
    ],
)
def test_usage_errors(mu2: np.ndarray, cov2: np.ndarray, n: int) -> None:
    with pytest.raises(UsageError):
        sliced_wasserstein_gaussians(t(MU1), t(COV1), t(mu2), t(cov2), n, gen())


def test_mean_needs_two_classes() -> None:
    with pytest.raises(UsageError):
        mean_sliced_wasserstein({0: (t(MU1), t(COV1))}, 10, gen())
