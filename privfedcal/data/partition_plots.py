"""Heatmap of a partition's client x class counts, with a histogram of client sizes beside
it when there are too many clients to read their rows (style: privfedcal/report/style/plotstyle.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from privfedcal.data.sizes import size_distribution
from privfedcal.report.style.plotstyle import COUNTS, colour, new_figure, save, styled

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_ANNOTATE_MAX_CELLS = 400  # beyond this the numbers are unreadable; the colours still speak
_NAMED_TICKS_MAX = 40  # more classes (or clients) than this: index ticks every few


def _ticks(n: int) -> list[int]:
    """Every index up to 40 items; beyond, every 10th (20th past 200) so labels never overlap."""
    if n <= _NAMED_TICKS_MAX:
        return list(range(n))
    return list(range(0, n, 10 if n <= 200 else 20))


def plot_partition(counts: np.ndarray, path: str | Path, *, classes: list[str] | None = None,
                   title: str = "") -> Path:
    """Write a (clients x classes) heatmap of ``counts`` to ``path`` (PNG); return the path.

    Up to 40 classes the axis names each class; with more (CIFAR-100) it ticks class indices
    every 10 (names are in partition.json), so labels never overlap. Past 40 clients (a
    natural partition's users) a second panel shows how many clients hold how many samples."""
    counts = np.asarray(counts)
    k, c = counts.shape
    sizes_panel = k > _NAMED_TICKS_MAX
    width = 2.5 + (0.42 * c if c <= _NAMED_TICKS_MAX else min(0.11 * c, 12))
    height = 1.6 + (0.32 * k if k <= _NAMED_TICKS_MAX else min(0.09 * k, 10))
    with styled():
        fig = new_figure(min(width, 18) + (4.5 if sizes_panel else 0), min(height, 14))
        ax, hist = (fig.subplots(1, 2, width_ratios=(min(width, 18), 4.5)) if sizes_panel
                    else (fig.add_subplot(), None))
        image = ax.imshow(counts, aspect="auto", cmap=COUNTS, interpolation="nearest")
        fig.colorbar(image, ax=ax, label="samples", shrink=0.9)
        ax.grid(False)
        named = c <= _NAMED_TICKS_MAX and classes is not None and len(classes) == c
        xt = _ticks(c)
        labels = ([classes[i] for i in xt] if named and classes is not None
                  else [str(i) for i in xt])
        slant = named and max(map(len, labels), default=0) > 2
        ax.set_xticks(xt, labels, rotation=60 if slant else 0,
                      ha="right" if slant else "center",
                      rotation_mode="anchor" if slant else "default")
        ax.set_xlabel("class" if c <= _NAMED_TICKS_MAX else
                      "class index (names in partition.json)")
        yt = _ticks(k)
        ax.set_yticks(yt, [str(i) for i in yt])
        ax.set_ylabel("client")
        if k * c <= _ANNOTATE_MAX_CELLS:
            threshold = counts.max() / 2 if counts.size else 0
            for (i, j), v in np.ndenumerate(counts):
                ax.text(j, i, str(int(v)), ha="center", va="center", fontsize=7,
                        color="black" if v > threshold else "white")
        if hist is not None:
            _size_histogram(hist, counts.sum(axis=1))
        if title:
            (fig.suptitle if hist is not None else ax.set_title)(title)
        return save(fig, path, dpi=100)


def _size_histogram(ax: Axes, sizes: np.ndarray) -> None:
    """Clients per size bin (``sizes.size_distribution``'s integer bins)."""
    dist = size_distribution(sizes.astype(np.int64))
    edges, counts = dist["histogram"]["edges"], dist["histogram"]["counts"]
    ax.stairs(counts, edges, fill=True, color=colour(0))
    ax.axvline(dist["percentiles"]["p50"], color=colour(1), linestyle="--",
               label=f"median {dist['percentiles']['p50']:g}")
    ax.set_xlabel("samples per client")
    ax.set_ylabel("clients")
    ax.legend(loc="upper right")
