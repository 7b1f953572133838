"""Clopper-Pearson bounds and the epsilon lower bound, against scipy and by hand."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import binomtest

from privfedcal.privacy.empirical import clopper_pearson_upper, epsilon_lower_bound


@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_upper_bound_matches_scipy_exact_interval(kn):
    k, n = kn
    # scipy's two-sided exact interval at level 1 - 2a has the one-sided upper bound at 1 - a
    ref = binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact").high
    assert clopper_pearson_upper(k, n, 0.95) == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_zero_successes_has_closed_form():
    # P(0 successes | p) = (1 - p)^n = 1 - c  =>  p = 1 - (1 - c)^(1/n)
    assert clopper_pearson_upper(0, 100, 0.975) == pytest.approx(1 - 0.025 ** (1 / 100))


def test_perfect_distinguisher_bound_by_hand():
    # no errors in 1000 + 1000 trials: both rates <= 1 - 0.025^(1/1000) = 0.003682
    u = 1 - 0.025 ** (1 / 1000)
    assert epsilon_lower_bound(0, 1000, 0, 1000) == pytest.approx(math.log((1 - u) / u))
    assert epsilon_lower_bound(0, 1000, 0, 1000) > 5.6


def test_coin_flip_gives_zero_and_delta_lowers_the_bound():
    assert epsilon_lower_bound(500, 1000, 500, 1000) == 0.0
    assert epsilon_lower_bound(10, 1000, 10, 1000, delta=1e-2) < epsilon_lower_bound(10, 1000, 10, 1000)


@pytest.mark.parametrize("args", [(-1, 10, 0, 10), (0, 0, 0, 10), (11, 10, 0, 10)])
def test_bad_counts_are_refused(args):
    with pytest.raises(ValueError):
        epsilon_lower_bound(*args)


# ---- many thresholds at once, the choice of one, and the split -------------------------------
import numpy as np  # noqa: E402

from privfedcal.privacy.empirical import (  # noqa: E402
    choose_threshold,
    epsilon_lower_bounds,
    errors_at,
    split_bound,
)


@given(st.integers(1, 300), st.integers(1, 300), st.data(),
       st.sampled_from([0.0, 1e-5, 0.05]), st.sampled_from([0.9, 0.95, 0.999]))
def test_vectorised_bounds_equal_the_scalar_one(n0, n1, data, delta, conf):
    fp = data.draw(st.lists(st.integers(0, n0), min_size=1, max_size=5))
    fn = data.draw(st.lists(st.integers(0, n1), min_size=len(fp), max_size=len(fp)))
    got = epsilon_lower_bounds(np.array(fp), n0, np.array(fn), n1, delta, conf)
    want = [epsilon_lower_bound(a, n0, b, n1, delta, conf) for a, b in zip(fp, fn, strict=True)]
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_errors_at_counts_by_hand():
    # rule: score > t means D'. t = 1: negatives 2 > 1 (one), positives 1 <= 1 (one)
    fp, fn = errors_at([0.0, 1.0, 2.0], [1.0, 3.0], np.array([1.0, -np.inf, 3.0]))
    assert fp.tolist() == [1, 3, 0] and fn.tolist() == [1, 0, 2]


def test_threshold_sits_in_the_middle_of_the_gap():
    # the only threshold without errors lies between 19 and 30
    t, eps = choose_threshold(np.arange(20.0), np.arange(30.0, 50.0))
    assert t == 24.5 and eps == pytest.approx(epsilon_lower_bound(0, 20, 0, 20)) and eps > 1


def test_split_chooses_on_the_first_half_and_counts_the_second():
    # first halves separate at 5; second halves are swapped: all 50 + 50 are errors
    neg = np.r_[np.zeros(50), np.full(50, 10.0)]
    pos = np.r_[np.full(50, 10.0), np.zeros(50)]
    r = split_bound(neg, pos)
    assert r["threshold"] == 5.0
    assert (r["false_pos"], r["negatives"], r["false_neg"], r["positives"]) == (50, 50, 50, 50)
    assert r["eps_lower"] == 0.0
    # perfectly separated throughout: the bound of no errors in 500 + 500 counted trials
    r = split_bound(np.zeros(1000), np.ones(1000))
    u = 1 - 0.025 ** (1 / 500)
    assert r["eps_lower"] == pytest.approx(math.log((1 - u) / u))


def test_split_bound_refuses_too_few_trials():
    with pytest.raises(ValueError):
        split_bound([0.0], [1.0, 2.0])


# ---- the one-run bound ---------------------------------------------------------------------
from scipy.stats import binom  # noqa: E402

from privfedcal.privacy.empirical import one_run_epsilon, one_run_p_value  # noqa: E402


def test_one_run_without_delta_is_a_binomial_tail():
    # r = v = 100 right guesses: p = q^100 <= 0.05 exactly when q <= 0.05^(1/100)
    q = 0.05 ** (1 / 100)
    assert one_run_epsilon(100, 100, 100, 0.0, 0.95) == pytest.approx(math.log(q / (1 - q)),
                                                                     abs=1e-5)
    assert one_run_p_value(500, 200, 150, 1.0, 0.0) == pytest.approx(
        binom.sf(149, 200, math.e / (1 + math.e)))


@pytest.mark.parametrize(("m", "r", "v", "eps", "delta"),
                         [(1000, 600, 600, 3.0, 1e-5), (300, 40, 31, 0.5, 1e-3)])
def test_one_run_delta_term_by_a_plain_loop(m, r, v, eps, delta):
    q = math.exp(eps) / (1 + math.exp(eps))
    worst = max(sum(binom.pmf(k, r, q) for k in range(v - i, v)) / i for i in range(1, v + 1))
    want = min(1.0, binom.sf(v - 1, r, q) + 2 * m * delta * worst)
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(want, rel=1e-9)


def test_one_run_epsilon_is_the_edge_of_refutation():
    eps = one_run_epsilon(1000, 300, 260, 1e-5, 0.95)
    assert one_run_p_value(1000, 300, 260, eps, 1e-5) <= 0.05
    assert one_run_p_value(1000, 300, 260, eps + 1e-4, 1e-5) > 0.05
    assert one_run_epsilon(1000, 300, 150, 1e-5, 0.95) == 0.0   # a coin's score
    with pytest.raises(ValueError):
        one_run_p_value(10, 5, 6, 1.0, 0.0)
