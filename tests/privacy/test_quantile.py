"""The DP quantile of feature norms that chooses the feature clip (privacy/quantile.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import RDPAccountant

from privfedcal.errors import UsageError
from privfedcal.privacy import quantile as qmod
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.quantile import (
    QUANTILE_RELEASE,
    SENSITIVITY,
    ClipSearch,
    check_edges,
    composed_epsilon,
    feature_norms,
    geometric_edges,
    noisy_norm_histogram,
    norm_histogram,
    plan_clip_noise,
    private_feature_clip,
    private_quantile,
    quantile_from_histogram,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lognormal_clients(seed: int, clients: int = 10, per_client: int = 200
                      ) -> tuple[list[torch.Tensor], torch.Generator]:
    """Norms of ``clients`` x ``per_client`` samples: a log-normal (sigma 0.3) whose scale
    is drawn log-uniformly in [0.5, 200], so that the grid's position is not favoured."""
    g = gen(seed)
    scale = math.exp(float(torch.empty(1).uniform_(math.log(0.5), math.log(200), generator=g)))
    return [scale * torch.exp(0.3 * torch.randn(per_client, generator=g, dtype=torch.float64))
            for _ in range(clients)], g


# --- the histogram and its sensitivity -----------------------------------------------------

def test_histogram_bins_are_right_closed_as_numpy_digitize():
    edges = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    norms = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 7.9, 8.0, 8.1, 100.0, math.inf, math.nan])
    # numpy: bin i holds e_{i-1} < x <= e_i; inf and nan count in the last bin
    finite = norms[torch.isfinite(norms)].numpy()
    ref = np.bincount(np.digitize(finite, edges.numpy(), right=True), minlength=5)
    ref[-1] += 2
    assert norm_histogram(norms, edges).tolist() == ref.tolist()
    assert ref.tolist() == [2, 2, 2, 2, 4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1e5, allow_nan=False), min_size=1, max_size=60),
       st.integers(0, 10_000))
def test_removing_one_sample_moves_the_histogram_by_the_sensitivity(norms, pick):
    """Neighbouring datasets (one sample removed) give histograms at L2 distance exactly
    1 = SENSITIVITY: one bin loses one count."""
    edges = ClipSearch().first_edges()
    full = torch.tensor(norms, dtype=torch.float64)
    i = pick % len(norms)
    less = torch.cat([full[:i], full[i + 1:]])
    diff = norm_histogram(full, edges) - norm_histogram(less, edges)
    assert float(diff.norm()) == pytest.approx(SENSITIVITY)
    assert SENSITIVITY == 1.0


@pytest.mark.parametrize("share", [1.0, 0.25])
def test_noise_std_is_the_multiplier_times_the_sensitivity(share):
    """The released histogram minus the true one has std z * 1 * sqrt(share) per bin
    (4002 bins: the empirical std is within 4% at 5 sigma). Fails with the sensitivity
    halved (std z/2) or the noise off (std 0)."""
    z = 2.5
    edges = geometric_edges(1.0, 2.0 ** 500, 8)  # 4001 edges, 4002 bins
    norms = torch.rand(3000, generator=gen(1), dtype=torch.float64) * 50
    clean = norm_histogram(norms, edges)
    noisy = noisy_norm_histogram(norms, edges, z, share=share, generator=gen(2))
    noise = (noisy - clean).numpy()
    assert noise.size == 4002
    assert abs(noise.mean()) < 5 * z * math.sqrt(share) / math.sqrt(noise.size)
    assert np.std(noise) == pytest.approx(z * math.sqrt(share), rel=0.04)


def test_default_noise_comes_from_os_entropy_not_torch_seed():
    edges = ClipSearch().first_edges()
    norms = torch.ones(10)
    torch.manual_seed(0)
    a = noisy_norm_histogram(norms, edges, 1.0)
    torch.manual_seed(0)
    b = noisy_norm_histogram(norms, edges, 1.0)
    assert not torch.equal(a, b)


# --- the server half ------------------------------------------------------------------------

def test_quantile_from_a_clean_histogram_is_the_geometric_interpolation():
    edges = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    hist = torch.tensor([0.0, 10.0, 80.0, 10.0, 0.0])  # N = 100
    # counts above the edges: 100, 90, 10, 0. q = 0.9: 10 above -> edge 4 exactly.
    assert quantile_from_histogram(hist, edges, 0.9) == pytest.approx(4.0)
    # q = 0.5: 50 above lies between 90 (edge 2) and 10 (edge 4), t = 40/80 -> 2 * 2^0.5
    assert quantile_from_histogram(hist, edges, 0.5) == pytest.approx(2 * math.sqrt(2))
    # q = 0.95 with N = 100 public: 5 above, between 10 (edge 4) and 0 (edge 8), t = 1/2
    assert quantile_from_histogram(hist, edges, 0.95, num_examples=100) == pytest.approx(
        4 * math.sqrt(2))
    # everything below the first edge: the first edge; above the last: the last
    assert quantile_from_histogram(torch.tensor([5.0, 0, 0, 0, 0]), edges, 0.9) == 1.0
    assert quantile_from_histogram(torch.tensor([0.0, 0, 0, 0, 5]), edges, 0.9) == 8.0


def test_noisy_counts_above_are_fitted_non_increasing():
    """Isotonic post-processing: a noisy dip and rise in the tail does not move the
    estimate past the bump (pool adjacent violators, against a hand-computed fit)."""
    y = torch.tensor([10.0, 4.0, 6.0, 1.0, 2.0, 0.0])
    assert qmod._non_increasing(y).tolist() == [10.0, 5.0, 5.0, 1.5, 1.5, 0.0]


def test_fine_edges_stay_inside_the_range_around_the_located_median():
    s = ClipSearch(low=0.1, high=100.0, per_octave=4, below=1.0, above=2.0)
    e = s.fine_edges(10.0)
    assert float(e[0]) == pytest.approx(5.0) and float(e[-1]) == pytest.approx(40.0)
    assert len(e) == 13                                     # 3 octaves x 4 + 1
    assert float(s.fine_edges(100.0)[-1]) == pytest.approx(100.0)
    assert float(s.fine_edges(100.0)[0]) == pytest.approx(50.0)
    assert float(s.fine_edges(0.1)[0]) == pytest.approx(0.1)
    coarse = s.first_edges()
    assert float(coarse[0]) == 0.1 and float(coarse[-1]) >= 100.0
    assert float((coarse[1:] / coarse[:-1]).max()) == pytest.approx(2.0)


# --- accounting -----------------------------------------------------------------------------

def test_clip_and_calibration_compose_within_the_target_in_opacus():
    """The clip's two stages and CCVR's one release, stepped into opacus' RDP accountant
    directly: the whole stays within epsilon 8 and spends it (the plan's 1e-3 precision),
    the clip's stages alone within their share, and the two stages cost exactly one
    Gaussian release of the planned multiplier (1/z1^2 + 1/z2^2 = 1/z^2)."""
    from opacus.accountants import RDPAccountant

    search = ClipSearch(share=0.1, locate_share=0.2)
    z_clip, (z_cal,) = plan_clip_noise(8.0, 1e-5, search)
    z1, z2 = search.stage_sigmas(z_clip)
    assert (z1, z2) == pytest.approx((z_clip / math.sqrt(0.2), z_clip / math.sqrt(0.8)))
    acc = RDPAccountant()
    for z in (z_cal, z1, z2):
        acc.step(noise_multiplier=z, sample_rate=1.0)
    total = acc.get_epsilon(delta=1e-5)
    assert 8.0 * (1 - 5e-3) < total <= 8.0
    alone, one = RDPAccountant(), RDPAccountant()
    for z in (z1, z2):
        alone.step(noise_multiplier=z, sample_rate=1.0)
    one.step(noise_multiplier=z_clip, sample_rate=1.0)
    assert 0.8 * (1 - 5e-3) < alone.get_epsilon(delta=1e-5) <= 0.8
    assert alone.get_epsilon(delta=1e-5) == pytest.approx(one.get_epsilon(delta=1e-5),
                                                          rel=1e-9)
    calibration = [(qmod.ONE_SHOT, z_cal)]
    assert composed_epsilon(z_clip, search, calibration, 1e-5) == pytest.approx(total,
                                                                                rel=1e-9)
    # the calibration release gets more than 0.9 of the budget: composition is subadditive
    (z_alone,) = plan_noise(8.0 * 0.9, 1e-5, [ReleasePlan("c", 1.0, 1)])
    assert z_cal < z_alone


def test_plan_refuses_a_share_taken_by_another_group():
    dpsgd = ReleasePlan("dp-sgd", 0.1, 100, share=0.5)
    with pytest.raises(UsageError, match="budget share"):
        plan_clip_noise(8.0, 1e-5, ClipSearch(share=0.5), [dpsgd])


# --- accuracy -------------------------------------------------------------------------------

@pytest.mark.parametrize(("epsilon", "quantile", "tolerance"), [
    (8.0, 0.1, 0.05), (8.0, 0.5, 0.03), (8.0, 0.9, 0.06), (8.0, 0.95, 0.06), (8.0, 0.99, 0.15),
    (1.0, 0.1, 0.1), (1.0, 0.5, 0.05), (1.0, 0.9, 0.1), (1.0, 0.95, 0.2), (1.0, 0.99, 0.6)])
def test_estimate_lands_near_the_true_quantile(epsilon, quantile, tolerance):
    """10 clients x 200 samples, the clip's release alone at ``epsilon``: the estimate is
    within a factor exp(tolerance) of the true quantile on five draws. Over 40 draws the
    largest |log(estimate / true)| were 0.025, 0.008, 0.038, 0.038, 0.080 at epsilon 8 and
    0.059, 0.026, 0.069, 0.119, 0.36 at epsilon 1 (0.1, 0.5, 0.9, 0.95, 0.99): 0.99 leaves
    20 samples above it against a per-bin noise std of 14 at epsilon 1."""
    (z,) = plan_noise(epsilon, 1e-5, [ReleasePlan(QUANTILE_RELEASE, 1.0, 1)])
    for seed in range(5):
        norms, g = lognormal_clients(seed)
        true = float(torch.cat(norms).quantile(quantile))
        est = private_quantile(norms, ClipSearch(quantile=quantile), z, generator=g)
        assert abs(math.log(est / true)) < tolerance, (seed, est, true)


def test_private_feature_clip_end_to_end():
    """A feature map on each client's inputs, given as one tensor or as (x, y) batches:
    the clip is near the default quantile (the median) of the feature norms and the plan
    spends <= 8."""
    weight = torch.randn(6, 3, generator=gen(3))
    feats = lambda x: x @ weight  # noqa: E731
    xs = [torch.randn(200, 6, generator=gen(10 + k)) * (1 + k / 10) for k in range(10)]
    batches = [[(x[i:i + 32], torch.zeros(len(x[i:i + 32]))) for i in range(0, 200, 32)]
               for x in xs[5:]]
    choice = private_feature_clip(feats, [*xs[:5], *batches], epsilon=8.0, delta=1e-5,
                                  generator=gen(4))
    true = float(torch.cat([feature_norms(feats, x) for x in xs]).quantile(
        ClipSearch().quantile))
    assert ClipSearch().quantile == 0.5
    assert abs(math.log(choice.clip / true)) < 0.05
    assert choice.epsilon <= 8.0 and len(choice.sigmas) == 1
    assert choice.clip_sigma > choice.sigmas[0]  # the clip's share is the smaller one
    # the calibration's epsilon alone: opacus at its multiplier, and planning one release
    # from it (as privatize_statistics does) gives that multiplier back, never less noise
    acc = RDPAccountant()
    acc.history = [(choice.sigmas[0], 1.0, 1)]
    (alone,) = choice.release_epsilons
    assert alone == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9) and alone < choice.epsilon
    (z,) = plan_noise(alone, 1e-5, [ReleasePlan("calibration", 1.0, 1)])
    assert choice.sigmas[0] <= z < choice.sigmas[0] * 1.002


def test_bad_input_is_one_usage_error():
    for kwargs in ({"quantile": 1.0}, {"share": 0.0}, {"low": 5.0, "high": 1.0},
                   {"locate_share": 1.0}, {"per_octave": 0}, {"above": 0.0}):
        with pytest.raises(UsageError):
            ClipSearch(**kwargs)
    with pytest.raises(UsageError):
        check_edges(torch.tensor([1.0, 1.0, 2.0]))
    with pytest.raises(UsageError):
        check_edges(torch.tensor([0.0, 1.0]))
    with pytest.raises(UsageError):
        noisy_norm_histogram(torch.ones(3), torch.tensor([1.0]), 0.0)
    with pytest.raises(UsageError):
        quantile_from_histogram(torch.ones(3), torch.tensor([1.0]), 0.9)  # 2 bins expected
    with pytest.raises(UsageError):
        private_feature_clip(lambda x: x, [torch.ones(2, 2)], epsilon=-1.0, delta=1e-5)


def test_each_stage_is_noised_at_its_planned_multiplier(monkeypatch):
    """private_quantile sends one histogram per client and stage, at the multipliers the
    accounting composes (stage_sigmas), never at less noise."""
    seen = []
    real = qmod.noisy_norm_histogram

    def spy(norms, edges, z, **kwargs):
        seen.append(z)
        return real(norms, edges, z, **kwargs)

    monkeypatch.setattr(qmod, "noisy_norm_histogram", spy)
    norms, g = lognormal_clients(0, clients=3, per_client=20)
    search = ClipSearch()
    private_quantile(norms, search, 2.0, generator=g)
    z1, z2 = search.stage_sigmas(2.0)
    assert seen == [z1] * 3 + [z2] * 3
