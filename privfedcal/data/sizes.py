"""How client sizes spread over a partition: percentiles and an integer-binned histogram.

A natural partition (one client per user) has as many clients as the data have users, often
thousands, with sizes from a handful of samples to hundreds; a per-client table no longer
reads, so ``privfedcal partition`` prints this summary and ``partition.json`` stores it.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from privfedcal.errors import UsageError

#: the percentiles reported (numpy's default linear interpolation between order statistics)
PERCENTILES = (10, 25, 50, 75, 90)
HISTOGRAM_BINS = 10
_BAR_WIDTH = 40  # characters of the longest histogram bar


def size_distribution(sizes: np.ndarray | list[int]) -> dict[str, Any]:
    """Min, max, mean, percentiles and a histogram of client sizes.

    The histogram has at most ``HISTOGRAM_BINS`` bins with integer edges: bin i counts the
    clients whose size s satisfies ``edges[i] <= s < edges[i + 1]`` (the last edge is max + 1).
    """
    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or sizes.size == 0 or not np.issubdtype(sizes.dtype, np.integer):
        raise UsageError("client sizes must be a non-empty 1-D integer array")
    lo, hi = int(sizes.min()), int(sizes.max())
    bins = min(HISTOGRAM_BINS, hi - lo + 1)
    edges = np.unique(np.round(np.linspace(lo, hi + 1, bins + 1)).astype(np.int64))
    counts, _ = np.histogram(sizes, bins=edges)
    return {
        "clients": int(sizes.size), "samples": int(sizes.sum()), "min": lo, "max": hi,
        "mean": float(sizes.mean()),
        "percentiles": {f"p{q}": float(v) for q, v in
                        zip(PERCENTILES, np.percentile(sizes, PERCENTILES), strict=True)},
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
    }


def size_lines(dist: dict[str, Any]) -> list[str]:
    """``size_distribution`` as text: one summary line, then one line per histogram bin
    (``lo-hi`` sizes, a bar, the number of clients)."""
    pct = ", ".join(f"{'median' if k == 'p50' else k} {v:g}" for k, v in dist["percentiles"].items())
    lines = [f"client sizes ({dist['clients']} clients, {dist['samples']} samples): "
             f"min {dist['min']}, {pct}, max {dist['max']}, mean {dist['mean']:.1f}"]
    edges, counts = dist["histogram"]["edges"], dist["histogram"]["counts"]
    ranges = [str(a) if b - a == 1 else f"{a}-{b - 1}" for a, b in pairwise(edges)]
    width, top = max(map(len, ranges)), max(counts)
    for r, c in zip(ranges, counts, strict=True):
        bar = "#" * (round(_BAR_WIDTH * c / top) if c else 0)
        lines.append(f"  {r:>{width}} | {bar}{' ' if bar else ''}{c}")
    return lines
