"""privfedcal/tensors.py: the fast finiteness check agrees with the element-wise one."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from privfedcal.tensors import all_finite


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([np.float16, np.float32, np.float64]).flatmap(
    lambda dt: arrays(dt, st.integers(0, 40),
                      elements=st.one_of(st.floats(width=np.finfo(dt).bits, allow_nan=True,
                                                   allow_infinity=True),
                                         st.sampled_from([float(np.finfo(dt).max),
                                                          -float(np.finfo(dt).max)])))))
def test_all_finite_equals_the_elementwise_test(a):
    # includes finite tensors whose sum overflows (several +-max values): the sum alone
    # would call them non-finite
    t = torch.from_numpy(a)
    assert all_finite(t) == bool(np.isfinite(a).all())


def test_overflowing_sum_of_finite_values_is_finite_and_one_nan_is_not():
    big = torch.full((4,), torch.finfo(torch.float32).max)
    assert not bool(torch.isfinite(big.sum()))  # the case the fallback is for
    assert all_finite(big)
    t = torch.zeros(10, 256, 256, dtype=torch.float64)
    t[3, 7, 9] = float("nan")
    assert not all_finite(t)
    t[3, 7, 9] = float("-inf")
    assert not all_finite(t)
    assert all_finite(torch.tensor([1, 2, 3]))  # integers are always finite
