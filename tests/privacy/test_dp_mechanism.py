"""Clipping, the Gaussian mechanism on named payloads, PSD projection (privacy/dp.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.errors import UsageError
from privfedcal.privacy.dp import (
    FEATURES,
    GRADIENTS,
    L2Clip,
    default_delta,
    gaussian_mechanism,
    noise_stds,
    noisy_stats_to_moments,
    project_psd,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- defaults and sensitivities ------------------------------------------------------------

def test_default_delta_is_below_one_over_ten_n():
    assert default_delta(1000) == 1e-5                      # 1/(10*1000) = 1e-4 > 1e-5
    assert default_delta(50_000) == pytest.approx(2e-6)     # 1/(10*50000)
    with pytest.raises(UsageError):
        default_delta(0)


def test_bound_and_sensitivities():
    bound = L2Clip({FEATURES: 2.0, GRADIENTS: 0.5})
    rows = torch.full((3, 4), 10.0)
    assert torch.allclose(bound.clip(rows, FEATURES).norm(dim=1), torch.full((3,), 2.0))
    assert torch.allclose(bound.clip(rows, GRADIENTS).norm(dim=1), torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="known kinds"):
        bound.clip(rows, "gradients")


# --- L2Clip -------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       scale=st.floats(1e-3, 1e3), bound=st.floats(0.1, 10), seed=st.integers(0, 2**16))
def test_l2clip_norms_bounded_and_inside_rows_unchanged(n, shape, scale, bound, seed):
    rows = torch.randn(n, *shape, generator=gen(seed), dtype=torch.float64) * scale
    out = L2Clip(bound).clip(rows, "anything")
    before = rows.reshape(n, -1).norm(dim=1)
    after = out.reshape(n, -1).norm(dim=1)
    assert out.shape == rows.shape
    assert bool((after <= bound * (1 + 1e-12)).all())
    inside = before <= bound
    assert torch.equal(out[inside], rows[inside])                 # bit for bit
    # outside rows land on the sphere, same direction: out = rows * R/||row||
    expected = rows[~inside] * (bound / before[~inside]).reshape((-1,) + (1,) * len(shape))
    assert torch.allclose(out[~inside], expected, rtol=1e-12)


def test_l2clip_zero_rows_and_bad_bounds():
    assert torch.equal(L2Clip(1.0).clip(torch.zeros(2, 3), FEATURES), torch.zeros(2, 3))
    for bad in (0.0, -1.0, math.inf, {FEATURES: 0.0}):
        with pytest.raises(UsageError):
            L2Clip(bad)


# --- Gaussian mechanism -------------------------------------------------------------------

def test_noise_stds_formula():
    # K = 3 keys with positive sensitivity: std_k = z * sqrt(3) * s_k * sqrt(share)
    stds = noise_stds({"count": 1.0, "sum": 2.0, "outer": 4.0, "const": 0.0}, 0.5, share=0.25)
    r3 = math.sqrt(3)
    assert stds == pytest.approx({"count": 0.5 * r3 * 0.5, "sum": 0.5 * r3 * 2 * 0.5,
                                  "outer": 0.5 * r3 * 4 * 0.5, "const": 0.0})


def test_noise_budget_split_is_one_gaussian_mechanism_with_the_same_multiplier():
    """Budget shares w_k (normalised over the keys with a positive sensitivity): std_k =
    z s_k / sqrt(w_k). Any change that moves each key by at most its sensitivity then has a
    noise-scaled (Mahalanobis) length of at most 1/z, exactly as with equal shares, which are
    the default (and w_k = 1/K gives the formula above)."""
    sens = {"grad": 0.5, "count": 1.0, "const": 0.0}
    z = 2.0
    stds = noise_stds(sens, z, budget={"grad": 9.0, "count": 1.0})  # normalised: 0.9 / 0.1
    assert stds == pytest.approx({"grad": z * 0.5 / math.sqrt(0.9),
                                  "count": z * 1.0 / math.sqrt(0.1), "const": 0.0})
    assert noise_stds(sens, z, budget={"grad": 1.0, "count": 1.0}) == pytest.approx(
        noise_stds(sens, z))
    for split in (None, {"grad": 0.9, "count": 0.1}, {"grad": 0.01, "count": 0.99}):
        st_ = noise_stds(sens, z, budget=split)
        worst = math.sqrt(sum((s / st_[k]) ** 2 for k, s in sens.items() if s > 0))
        assert worst == pytest.approx(1 / z)
    assert noise_stds(sens, z, share=0.25, budget={"grad": 0.9, "count": 0.1})["grad"] == \
        pytest.approx(0.5 * stds["grad"])
    with pytest.raises(ValueError, match="budget share"):
        noise_stds(sens, z, budget={"grad": 1.0})  # count has none
    m = 20_000
    clean = {"grad": torch.zeros(m, 3, dtype=torch.float64),
             "count": torch.zeros(m, 3, dtype=torch.float64)}
    noisy = gaussian_mechanism(clean, sens, z, gen(4), budget={"grad": 0.9, "count": 0.1})
    for k in ("grad", "count"):
        assert float(noisy[k].std(0).mean()) == pytest.approx(stds[k], rel=0.03)


def _stats_payload(m: int, seed: int) -> dict[str, torch.Tensor]:
    """m identical copies of a small CCVR payload (C=3, d=2): m independent noise draws."""
    z = torch.randn(7, 2, generator=gen(seed), dtype=torch.float64)
    y = torch.tensor([0, 0, 2, 2, 2, 0, 2])
    count = torch.bincount(y, minlength=3)
    total = torch.zeros(3, 2, dtype=torch.float64).index_add_(0, y, z)
    outer = torch.zeros(3, 2, 2, dtype=torch.float64).index_add_(0, y, z[:, :, None] * z[:, None])
    return {"count": count.expand(m, 3).clone(), "sum": total.expand(m, 3, 2).clone(),
            "outer": outer.expand(m, 3, 2, 2).clone()}


def test_gaussian_mechanism_unbiased_with_known_std():
    m, zmult, sens = 20_000, 0.8, {"count": 1.0, "sum": 1.5, "outer": 2.25}
    clean = _stats_payload(m, 0)
    noisy = gaussian_mechanism(clean, sens, zmult, gen(1))
    assert noisy["count"].dtype == torch.get_default_dtype()          # ints come back as float
    for k, s in sens.items():
        std = zmult * math.sqrt(3) * s                                 # independent formula
        err = (noisy[k] - clean[k].to(noisy[k].dtype)).double()
        # mean over m draws has std std/sqrt(m): 5 sigma per element
        assert float(err.mean(0).abs().max()) < 5 * std / math.sqrt(m)
        assert float(err.std(0).min()) > 0.97 * std and float(err.std(0).max()) < 1.03 * std


def test_distributed_shares_sum_to_full_variance():
    m, n, zmult, sens = 20_000, 5, 1.3, {"count": 1.0, "sum": 1.0, "outer": 1.0}
    clean = _stats_payload(m, 2)
    total = sum(gaussian_mechanism(clean, sens, zmult, gen(10 + i), share=1 / n)["sum"] - clean["sum"]
                for i in range(n))
    full = zmult * math.sqrt(3)
    assert float(total.std(0).min()) > 0.97 * full and float(total.std(0).max()) < 1.03 * full
    one = gaussian_mechanism(clean, sens, zmult, gen(3), share=1 / n)["sum"] - clean["sum"]
    assert float(one.std(0).mean()) == pytest.approx(full / math.sqrt(n), rel=0.03)


def test_gaussian_mechanism_refuses_unknown_keys_and_is_reproducible():
    payload = {"sum": torch.ones(2, 3), "holders": torch.ones(2)}
    with pytest.raises(UsageError, match="holders"):
        gaussian_mechanism(payload, {"sum": 1.0}, 1.0, gen(0))
    sens = {"sum": 1.0, "holders": 1.0, "unused": 5.0}
    a = gaussian_mechanism(payload, sens, 1.0, gen(4))
    b = gaussian_mechanism(payload, sens, 1.0, gen(4))
    c = gaussian_mechanism(payload, sens, 1.0, gen(5))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["sum"], c["sum"])
    # zero sensitivity: released exactly and not counted in K (std of "sum" = z * sqrt(1))
    out = gaussian_mechanism({"sum": torch.zeros(50_000), "shape": torch.ones(2)},
                             {"sum": 1.0, "shape": 0.0}, 2.0, gen(6))
    assert torch.equal(out["shape"], torch.ones(2))
    assert float(out["sum"].std()) == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError):
        gaussian_mechanism(payload, sens, 1.0, gen(0), share=0.0)


# --- PSD projection and moments -----------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 6), batch=st.integers(1, 3), floor=st.sampled_from([0.0, 1e-3]),
       seed=st.integers(0, 2**16))
def test_project_psd_matches_numpy_clamped_spectrum(d, batch, floor, seed):
    a = torch.randn(batch, d, d, generator=gen(seed), dtype=torch.float64)
    out = project_psd(a, floor)
    sym = 0.5 * (a.numpy() + np.swapaxes(a.numpy(), -1, -2))
    w, v = np.linalg.eigh(sym)
    ref = np.einsum("bij,bj,bkj->bik", v, np.maximum(w, floor), v)
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-10)
    assert torch.equal(out, out.transpose(-1, -2))
    assert float(torch.linalg.eigvalsh(out).min()) >= floor - 1e-10


def test_project_psd_keeps_psd_input_and_dtype():
    b = torch.randn(4, 3, generator=gen(7))
    psd = b.T @ b
    out = project_psd(psd)
    assert out.dtype == torch.float32 and torch.allclose(out, psd, atol=1e-5)


def test_noisy_stats_to_moments_exact_on_clean_sums():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(9, 3))
    y = np.array([0, 0, 0, 1, 1, 1, 1, 0, 1])
    count = torch.tensor(np.bincount(y, minlength=3), dtype=torch.float64)
    total = torch.tensor(np.stack([z[y == c].sum(0) for c in range(3)]))
    outer = torch.tensor(np.stack([z[y == c].T @ z[y == c] for c in range(3)]))
    n, mean, cov = noisy_stats_to_moments(count - torch.tensor([0, 0, 0.4]), total, outer)
    assert n.tolist() == [4, 5, 0]                                    # -0.4 clamped to 0
    for c in (0, 1):
        np.testing.assert_allclose(mean[c].numpy(), z[y == c].mean(0), atol=1e-12)
        np.testing.assert_allclose(cov[c].numpy(), np.cov(z[y == c].T, ddof=1), atol=1e-12)
    assert torch.equal(cov[2], torch.zeros(3, 3, dtype=torch.float64))   # empty class: 0, not NaN
