"""Heatmap of a partition's client x class counts (matplotlib, Agg canvas, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_ANNOTATE_MAX_CELLS = 400  # beyond this the numbers are unreadable; the colours still speak


def plot_partition(counts: np.ndarray, path: str | Path, *, classes: list[str] | None = None,
                   title: str = "") -> Path:
    """Write a (clients x classes) heatmap of ``counts`` to ``path`` (PNG); return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(counts)
    k, c = counts.shape
    fig = Figure(figsize=(min(2 + 0.45 * c, 24), min(1.5 + 0.35 * k, 24)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if c <= 40:
        ax.set_xticks(range(c), labels=classes if classes is not None else range(c), rotation=90)
    if k <= 40:
        ax.set_yticks(range(k), labels=range(k))
    if k * c <= _ANNOTATE_MAX_CELLS:
        threshold = counts.max() / 2 if counts.size else 0
        for (i, j), v in np.ndenumerate(counts):
            ax.text(j, i, str(int(v)), ha="center", va="center", fontsize=7,
                    color="black" if v > threshold else "white")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
