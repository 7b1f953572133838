"""Client size distribution: percentiles and integer histogram bins against hand counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.data.sizes import size_distribution, size_lines
from privfedcal.errors import UsageError


def test_golden_distribution():
    sizes = [3, 5, 5, 8, 40, 41, 200]
    d = size_distribution(np.array(sizes))
    assert (d["clients"], d["samples"], d["min"], d["max"]) == (7, 302, 3, 200)
    assert d["mean"] == pytest.approx(302 / 7)
    # linear interpolation between order statistics at rank q/100 * (n - 1), by hand:
    # p10: rank 0.6 -> 3 + 0.6 * (5 - 3); p25: rank 1.5 -> 5; p50: rank 3 -> 8;
    # p75: rank 4.5 -> 40.5; p90: rank 5.4 -> 41 + 0.4 * (200 - 41)
    assert d["percentiles"] == pytest.approx({"p10": 4.2, "p25": 5.0, "p50": 8.0, "p75": 40.5,
                                              "p90": 104.6})
    # 10 bins over [3, 201): round(linspace(3, 201, 11))
    assert d["histogram"]["edges"] == [3, 23, 43, 62, 82, 102, 122, 142, 161, 181, 201]
    assert d["histogram"]["counts"] == [4, 2, 0, 0, 0, 0, 0, 0, 0, 1]


def test_few_distinct_sizes_get_one_bin_each():
    d = size_distribution(np.array([7, 8, 8, 9]))
    assert d["histogram"] == {"edges": [7, 8, 9, 10], "counts": [1, 2, 1]}
    lines = size_lines(d)
    assert lines[0] == ("client sizes (4 clients, 32 samples): min 7, p10 7.3, p25 7.75, "
                        "median 8, p75 8.25, p90 8.7, max 9, mean 8.0")
    assert lines[1:] == ["  7 | " + "#" * 20 + " 1", "  8 | " + "#" * 40 + " 2",
                         "  9 | " + "#" * 20 + " 1"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=300))
def test_bins_partition_the_clients(sizes):
    d = size_distribution(np.array(sizes))
    edges, counts = d["histogram"]["edges"], d["histogram"]["counts"]
    assert edges[0] == min(sizes) and edges[-1] == max(sizes) + 1
    assert all(b > a for a, b in zip(edges, edges[1:], strict=False)) and len(counts) <= 10
    by_hand = [sum(a <= s < b for s in sizes) for a, b in zip(edges, edges[1:], strict=False)]
    assert counts == by_hand and sum(counts) == len(sizes)
    assert len(size_lines(d)) == 1 + len(counts)


@pytest.mark.parametrize("bad", [np.array([]), np.array([1.5, 2.0]), np.zeros((2, 2), int)])
def test_bad_sizes(bad):
    with pytest.raises(UsageError, match="client sizes"):
        size_distribution(bad)
