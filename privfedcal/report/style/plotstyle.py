"""One look for every privfedcal plot: a colour-blind-safe palette, readable fonts, and the
Agg canvas (no display, no pyplot global state).

Line colours are the Okabe-Ito palette (distinguishable under the common colour-vision
deficiencies); heatmaps use ``cividis``/``viridis``, which are perceptually uniform and read
in greyscale print. Series that may coincide get different line styles and markers as well
as colours (``series_style``), so that a line hidden under another still shows.

Usage::

    with styled():
        fig = new_figure(6, 3.5)
        ax = fig.add_subplot()
        ...
        save(fig, path)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.rcsetup import cycler

from privfedcal.report.style.palette import PALETTE

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

#: heatmap colour maps (sequential; diverging for signed data)
SEQUENTIAL = "cividis"
COUNTS = "viridis"
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
DPI = 120

RC: dict[RcKeyType, Any] = {
    "axes.prop_cycle": cycler(color=list(PALETTE)),
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.framealpha": 0.85,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.8,
    "lines.markersize": 5,
    "image.cmap": SEQUENTIAL,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.08,
    "figure.dpi": 100,
}

PathLike = str | os.PathLike[str]


@contextlib.contextmanager
def styled() -> Iterator[None]:
    """Apply the shared rc settings while a figure is built (they are read at draw time too,
    so keep ``save`` inside the block)."""
    with matplotlib.rc_context(RC):
        yield


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def series_style(i: int, *, markers: bool = True) -> dict[str, Any]:
    """Colour, line style and marker of the ``i``-th series: all three change, so that two
    equal series stay distinguishable (the later one is dashed with hollow markers)."""
    style: dict[str, Any] = {"color": colour(i), "linestyle": LINESTYLES[i % len(LINESTYLES)],
                             "zorder": 3 + i}
    if markers:
        style.update(marker=MARKERS[i % len(MARKERS)],
                     markerfacecolor="none" if i % 2 else colour(i))
    return style


def new_figure(width: float, height: float) -> Figure:
    """A figure on the Agg canvas (call inside ``styled()``)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: PathLike, dpi: int = DPI) -> Path:
    """Write ``fig`` as PNG (creating parent folders) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path


__all__ = ["PALETTE", "SEQUENTIAL", "COUNTS", "RC", "styled", "colour", "series_style",
           "new_figure", "save"]


#: where a point's label may go, in points from the point, tried in order
_LABEL_OFFSETS = ((4, 4), (4, -10), (-4, 4), (-4, -10), (4, 14), (4, -20), (-4, 14),
                  (-4, -20), (4, 24), (4, -30), (-4, 24), (-4, -30))


def label_points(ax: Any, labels: list[tuple[float, float, str]], *, fontsize: float = 6,
                 color: str | None = None) -> None:
    """Label every (x, y, text) point of ``ax`` so that no two labels overlap (and none
    covers another's point): each goes at the first of a few offsets around its point whose
    box is free, with a thin leader line when it is not the first; a label with no free
    place keeps the first offset. Call it after the axes' limits are final."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []  # display-space boxes of the labels drawn so far
    points = [ax.transData.transform((x, y)) for x, y, _ in labels]
    for (x, y, text), (px, py) in sorted(zip(labels, points, strict=True),
                                         key=lambda lp: (-lp[1][1], lp[1][0])):
        chosen = None
        for k, (dx, dy) in enumerate(_LABEL_OFFSETS):
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                              fontsize=fontsize, color=color,
                              ha="left" if dx >= 0 else "right")
            box = ann.get_window_extent(renderer).expanded(1.05, 1.1)
            clear = not any(box.overlaps(b) for b in placed) and not any(
                box.contains(qx, qy) for qx, qy in points if (qx, qy) != (px, py))
            if clear or k == len(_LABEL_OFFSETS) - 1:
                if not clear:
                    ann.remove()
                    ann = ax.annotate(text, (x, y), xytext=_LABEL_OFFSETS[0],
                                      textcoords="offset points", fontsize=fontsize,
                                      color=color)
                    box = ann.get_window_extent(renderer)
                elif k > 0:
                    ann.arrow_patch = None
                    ann.remove()
                    ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                                      fontsize=fontsize, color=color,
                                      ha="left" if dx >= 0 else "right",
                                      arrowprops=dict(arrowstyle="-", lw=0.4, color="grey",
                                                      shrinkA=0, shrinkB=2))
                chosen = box
                break
            ann.remove()
        placed.append(chosen)
