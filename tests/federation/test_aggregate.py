"""federation/aggregate.py: the weighted average of client states, against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.federation.aggregate import RunningAverage, weighted_average


def test_weighted_average_matches_hand_computation():
    s1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    s2 = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    avg = weighted_average([s1, s2], [1.0, 3.0])
    # (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5.0]; integer buffers take the max
    assert torch.equal(avg["w"], torch.tensor([2.5, 5.0]))
    assert int(avg["n"]) == 5


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0.5, 1000.0), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_weighted_average_is_numpys(weights, seed):
    g = torch.Generator().manual_seed(seed)
    states = [{"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g).double(),
               "n": torch.randint(0, 9, (), generator=g)} for _ in weights]
    avg = weighted_average(states, weights)
    w = np.array(weights) / np.sum(weights)
    for key, tol in (("w", 1e-5), ("b", 1e-12)):
        ref = np.einsum("k,k...->...", w, np.stack([s[key].numpy().astype(np.float64)
                                                    for s in states]))
        np.testing.assert_allclose(avg[key].numpy(), ref, rtol=tol, atol=tol)
    assert avg["w"].dtype == torch.float32 and avg["b"].dtype == torch.float64
    assert int(avg["n"]) == max(int(s["n"]) for s in states)


def test_running_average_counts_bytes_and_marks_nonfinite_states():
    run = RunningAverage([1.0, 3.0])
    run.add({"a": torch.ones(2), "b": torch.tensor([1.0, math.inf]), "n": torch.tensor(2)})
    marker = run.nonfinite_marker(0)
    assert list(marker) == ["b"] and math.isnan(float(marker["b"]))
    with pytest.raises(RuntimeError, match="averaged 1 of 2"):
        run.result()
    run.add({"a": torch.zeros(2), "b": torch.zeros(2), "n": torch.tensor(7)})
    assert run.nonfinite_marker(1) == {}
    assert run.bytes == 2 * (2 * 4 + 2 * 4 + 8)
    out = run.result()
    assert torch.equal(out["a"], torch.full((2,), 0.25)) and int(out["n"]) == 7


def test_later_states_are_checked_and_summed_like_the_first():
    """States after the first (added with one call for all their floating-point entries and
    checked by one reduction) are marked by their first non-finite entry, a finite state
    whose sum overflows is not marked, and a state with other entries is summed entry by
    entry: all as the first state is."""
    big = torch.full((4,), 3e38)  # finite, its sum is not
    states = [{"a": torch.ones(4), "b": torch.ones(2, dtype=torch.float64)},
              {"a": big, "b": torch.zeros(2, dtype=torch.float64)},
              {"a": torch.ones(4), "b": torch.tensor([0.0, math.nan], dtype=torch.float64)},
              {"b": torch.ones(2, dtype=torch.float64), "a": torch.tensor([math.inf] * 4)},
              {"a": torch.ones(4), "c": torch.ones(1)}]
    run = RunningAverage([1.0] * len(states))
    for s in states:
        run.add(s)
    assert [list(run.nonfinite_marker(i)) for i in range(5)] == [[], [], ["b"], ["a"], []]
    out = run.result()
    assert out["b"].dtype == torch.float64 and torch.isnan(out["b"][1])
    assert torch.equal(out["c"], torch.full((1,), 0.2))
