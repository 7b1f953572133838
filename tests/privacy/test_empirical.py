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
