"""PNG plots of the analyses: classifier norms (CCVR fig. 3), CKA (CCVR figs. 1-2, 11),
singular values (FedUV fig. 1).

Figures are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly (style and
palette: privfedcal/report/style/plotstyle.py), so this module never touches pyplot's global state or the
user's chosen backend, and never leaks open figures. Every function writes a PNG (creating
parent folders) and returns its path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from torch import Tensor

from privfedcal.analysis.cka import CKAResult
from privfedcal.errors import UsageError
from privfedcal.report.style.plotstyle import SEQUENTIAL, new_figure, save, series_style, styled

__all__ = ["plot_cka", "plot_classifier_norms", "plot_singular_values"]

PathLike = str | os.PathLike[str]


def _vector(values: Tensor | Sequence[float], name: str) -> np.ndarray:
    arr = (
        values.detach().cpu().double().numpy()
        if isinstance(values, Tensor)
        else np.asarray(values, float)
    )
    if arr.ndim != 1 or arr.size == 0:
        raise UsageError(f"{name} must be a non-empty 1-D sequence, got shape {arr.shape}")
    return arr


def _tick_style(labels: Sequence[str]) -> dict:
    """Slant long tick labels, anchored at their right end so they sit under their tick."""
    if max(map(len, labels), default=0) > 3:
        return {"rotation": 45, "ha": "right", "rotation_mode": "anchor"}
    return {}


def _save(fig: Figure, path: PathLike) -> Path:
    return save(fig, path)


def plot_classifier_norms(
    before: Tensor | Sequence[float],
    after: Tensor | Sequence[float],
    path: PathLike,
    class_names: Sequence[str] | None = None,
    *,
    labels: tuple[str, str] = ("before calibration", "after calibration"),
) -> Path:
    """Grouped bar chart of per-class classifier norms, two bars per class."""
    b, a = _vector(before, "before"), _vector(after, "after")
    if b.size != a.size:
        raise UsageError(f"before and after have {b.size} and {a.size} classes")
    names = (
        [str(i) for i in range(b.size)] if class_names is None else [str(c) for c in class_names]
    )
    if len(names) != b.size:
        raise UsageError(f"{len(names)} class names for {b.size} classes")
    with styled():
        return _norm_bars(b, a, names, labels, path)


def _norm_bars(b: np.ndarray, a: np.ndarray, names: list[str], labels: tuple[str, str],
               path: PathLike) -> Path:
    many = b.size > 30
    fig = new_figure(min(max(4.0, 0.4 * b.size + 1.5), 14), 3.2)
    ax = fig.add_subplot()
    idx = np.arange(b.size)
    width = 0.4
    ax.bar(idx - width / 2, b, width, label=labels[0], color=series_style(0)["color"],
           hatch=None if many else "//", edgecolor="white", linewidth=0.4)
    ax.bar(idx + width / 2, a, width, label=labels[1], color=series_style(1)["color"])
    ax.grid(axis="x", visible=False)
    if many:
        ax.set_xticks(idx[::10], [names[i] for i in idx[::10]])
    else:
        ax.set_xticks(idx, names, **_tick_style(names))
    ax.set_xlabel("class")
    ax.set_ylabel("L2 norm of classifier row")
    top = max(float(b.max()), float(a.max()), 1e-12)
    ax.set_ylim(min(0.0, float(b.min()), float(a.min())), 1.2 * top)  # room for the legend
    ax.legend(loc="upper center", ncol=2, frameon=False)
    return _save(fig, path)


def _cka_grid(data: CKAResult | Tensor | np.ndarray | Mapping) -> tuple[np.ndarray, list[str], list[str], str]:
    """(values, row labels, column labels, title) for the accepted inputs."""
    if isinstance(data, CKAResult):
        data = data.mean
    if isinstance(data, Tensor) or isinstance(data, np.ndarray):
        mat = np.asarray(data.detach().cpu().double() if isinstance(data, Tensor) else data, float)
        if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
            raise UsageError(f"a CKA matrix must be square, got shape {mat.shape}")
        ticks = [str(i) for i in range(mat.shape[0])]
        return mat, ticks, ticks, "pairwise CKA between clients"
    if not isinstance(data, Mapping) or not data:
        raise UsageError("plot_cka takes a (K, K) matrix, {layer: mean} or {series: {layer: mean}}")
    first = next(iter(data.values()))
    if isinstance(first, Mapping):
        layers = list(first)
        rows = list(data)
        try:
            mat = np.array([[float(data[r][layer]) for layer in layers] for r in rows])
        except KeyError as exc:
            raise UsageError(f"every series must cover the same layers; missing {exc}") from exc
        return mat, [str(r) for r in rows], [str(c) for c in layers], "mean pairwise CKA per layer"
    mat = np.array([[float(v) for v in data.values()]])
    return mat, ["mean"], [str(c) for c in data], "mean pairwise CKA per layer"


def _cka_floor(mat: np.ndarray) -> float:
    """Lower end of the colour / y scale: the smallest finite value rounded down to 0.05, so
    that CKA values bunched near 1 (the usual case) still differ visibly; 0 if none."""
    finite = mat[np.isfinite(mat)]
    if finite.size == 0:
        return 0.0
    return float(max(0.0, min(0.95, np.floor(finite.min() * 20) / 20)))


def plot_cka(data: CKAResult | Tensor | np.ndarray | Mapping, path: PathLike) -> Path:
    """CKA plot: a ``(K, K)`` client matrix, ``{layer: mean}`` (or a ``CKAResult``, plotted by
    its per-layer means) or ``{series: {layer: mean}}``.

    The last form puts e.g. methods or IID/non-IID as rows and layers as columns (CCVR fig. 11).
    Matrices are heatmaps whose scale runs from the smallest value (rounded down to 0.05) to
    1, so differences between values near 1 show; the scale is printed on the colour bar.
    A single series (one value per layer) is a dot plot by layer. Cells are annotated; NaN
    cells stay blank.
    """
    mat, rows, cols, title = _cka_grid(data)
    lo = _cka_floor(mat)
    digits = 3 if 1.0 - lo < 0.2 else 2
    with styled():
        if len(rows) == 1 and rows[0] == "mean":
            return _cka_by_layer(mat[0], cols, lo, digits, title, path)
        fig = new_figure(max(3.8, 0.75 * len(cols) + 2.2), max(2.4, 0.5 * len(rows) + 1.6))
        ax = fig.add_subplot()
        image = ax.imshow(mat, vmin=lo, vmax=1.0, cmap=SEQUENTIAL, aspect="auto",
                          interpolation="nearest")
        ax.grid(False)
        ax.set_xticks(np.arange(len(cols)), cols, **_tick_style(cols))
        ax.set_yticks(np.arange(len(rows)), rows)
        if mat.size <= 400:
            for (i, j), value in np.ndenumerate(mat):
                if np.isfinite(value):
                    pos = (value - lo) / max(1.0 - lo, 1e-12)
                    colour = "black" if pos > 0.55 else "white"
                    ax.text(j, i, f"{value:.{digits}f}", ha="center", va="center", fontsize=7,
                            color=colour)
        ax.set_title(title)
        if rows == cols and rows[0] == "0":
            ax.set_xlabel("client")
            ax.set_ylabel("client")
        fig.colorbar(image, ax=ax, label=f"CKA (scale {lo:g} to 1)")
        return _save(fig, path)


def _cka_by_layer(values: np.ndarray, layers: list[str], lo: float, digits: int, title: str,
                  path: PathLike) -> Path:
    fig = new_figure(max(4.0, 0.8 * len(layers) + 2), 3.2)
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    ax.plot(x, values, **series_style(0))
    for xi, v in zip(x, values, strict=True):
        if np.isfinite(v):
            ax.annotate(f"{v:.{digits}f}", (xi, v), xytext=(0, 6), textcoords="offset points",
                        ha="center", fontsize=8)
    ax.set_xticks(x, layers, **_tick_style(layers))
    ax.set_xlabel("layer (input to output)")
    ax.set_ylabel("mean pairwise CKA")
    ax.set_ylim(lo, 1.0 + 0.12 * (1.0 - lo) + 1e-3)
    ax.set_title(title)
    return _save(fig, path)


def plot_singular_values(
    svals: Mapping[str, Tensor | Sequence[float]], path: PathLike, *, log_y: bool = False
) -> Path:
    """Singular values of classifier weights by index, one line per setting (FedUV fig. 1).

    Each series has its own colour, line style and marker (later ones dashed with hollow
    markers, drawn on top), so equal series stay visible."""
    if not isinstance(svals, Mapping) or not svals:
        raise UsageError("plot_singular_values takes a non-empty {label: singular values} mapping")
    vectors = {str(label): np.sort(_vector(values, f"singular values of {label!r}"))[::-1]
               for label, values in svals.items()}
    with styled():
        fig = new_figure(5.0, 3.2)
        ax = fig.add_subplot()
        for i, (label, vec) in enumerate(vectors.items()):
            style = series_style(i, markers=vec.size <= 30)
            if i:
                style.update(markersize=7, linewidth=1.6)
            ax.plot(np.arange(1, vec.size + 1), vec, label=label, **style)
        if log_y:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(_integer_locator())
        ax.set_xlabel("index (largest first)")
        ax.set_ylabel("singular value")
        ax.legend()
        return _save(fig, path)


def _integer_locator():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)
