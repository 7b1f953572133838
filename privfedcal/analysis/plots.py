"""PNG plots of the analyses: classifier norms (CCVR fig. 3), CKA (CCVR figs. 1-2, 11),
singular values (FedUV fig. 1).

Figures are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly, so this
module never touches pyplot's global state or the user's chosen backend, and never leaks
open figures. Every function writes a PNG (creating parent folders) and returns its path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from privfedcal.analysis.cka import CKAResult
from privfedcal.errors import UsageError

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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    return path


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
    fig = Figure(figsize=(max(4.0, 0.5 * b.size + 2), 3.2))
    ax = fig.add_subplot()
    idx = np.arange(b.size)
    width = 0.4
    ax.bar(idx - width / 2, b, width, label=labels[0])
    ax.bar(idx + width / 2, a, width, label=labels[1])
    ax.set_xticks(idx, names, **_tick_style(names))
    ax.set_xlabel("class")
    ax.set_ylabel("L2 norm of classifier row")
    top = max(float(b.max()), float(a.max()), 1e-12)
    ax.set_ylim(min(0.0, float(b.min()), float(a.min())), 1.2 * top)  # room for the legend
    ax.legend(loc="upper center", ncol=2, frameon=False)
    return _save(fig, path)


def _cka_grid(data: Tensor | Mapping) -> tuple[np.ndarray, list[str], list[str], str]:
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


def plot_cka(data: CKAResult | Tensor | np.ndarray | Mapping, path: PathLike) -> Path:
    """Heatmap of CKA: a ``(K, K)`` client matrix, ``{layer: mean}`` (or a ``CKAResult``,
    plotted by its per-layer means) or ``{series: {layer: mean}}``.

    The last form puts e.g. methods or IID/non-IID as rows and layers as columns (CCVR fig. 11).
    Cells are annotated; the colour scale is fixed to [0, 1]. NaN cells stay blank.
    """
    mat, rows, cols, title = _cka_grid(data)
    fig = Figure(figsize=(max(3.5, 0.7 * len(cols) + 2), max(2.0, 0.5 * len(rows) + 1.5)))
    ax = fig.add_subplot()
    image = ax.imshow(mat, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(np.arange(len(cols)), cols, **_tick_style(cols))
    ax.set_yticks(np.arange(len(rows)), rows)
    if mat.size <= 400:
        for (i, j), value in np.ndenumerate(mat):
            if np.isfinite(value):
                colour = "black" if value > 0.6 else "white"
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_title(title)
    if rows == cols and rows[0] == "0":
        ax.set_xlabel("client")
        ax.set_ylabel("client")
    fig.colorbar(image, ax=ax)
    return _save(fig, path)


def plot_singular_values(
    svals: Mapping[str, Tensor | Sequence[float]], path: PathLike, *, log_y: bool = False
) -> Path:
    """Singular values of classifier weights by index, one line per setting (FedUV fig. 1)."""
    if not isinstance(svals, Mapping) or not svals:
        raise UsageError("plot_singular_values takes a non-empty {label: singular values} mapping")
    fig = Figure(figsize=(5.0, 3.2))
    ax = fig.add_subplot()
    for label, values in svals.items():
        vec = np.sort(_vector(values, f"singular values of {label!r}"))[::-1]
        ax.plot(
            np.arange(1, vec.size + 1),
            vec,
            marker="o" if vec.size <= 20 else None,
            label=str(label),
        )
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("index")
    ax.set_ylabel("singular value")
    ax.legend()
    return _save(fig, path)
