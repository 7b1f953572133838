"""``accuracy.png`` of a run, drawn with Pillow.

``privfedcal train`` writes this plot after every run; matplotlib takes about a second to
import, more than the whole training of the default experiment, so this one plot is drawn
directly: axes, grid, ticks, the accuracy line and, after calibration, the calibrated
accuracy as a marker, in the first and fourth colours of plotstyle.PALETTE (Okabe-Ito). The
other plots (reports, ``compare``, ``analyze``) use matplotlib (privfedcal/report/run_plots.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from privfedcal.report.style.palette import rgb

_W, _H = 720, 432  # pixels (6 x 3.6 inches at 120 dpi)
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 34, 46
_BLUE, _RED = rgb(0), rgb(3)  # the palette's first and fourth colours, as in plotstyle
_GRID, _INK = (225, 225, 225), (0, 0, 0)


def _ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    span = max(hi - lo, 1e-9)
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return f"{v:g}" if abs(v - round(v)) > 1e-9 else str(int(round(v)))


def _ranges(xs: list[float], all_y: list[float]) -> tuple[float, float, float, float]:
    """(x_lo, x_hi, y_lo, y_hi) of the axes: the rounds, and the accuracies padded by 5% of
    their span (at least one point) within [0, 100]; never an empty range."""
    y_lo, y_hi = (min(all_y), max(all_y)) if all_y else (0.0, 100.0)
    pad = max(1.0, 0.05 * (y_hi - y_lo))
    y_lo, y_hi = max(0.0, y_lo - pad), min(100.0, y_hi + pad)
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    if y_hi <= y_lo:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    return x_lo, x_hi, y_lo, y_hi


def _draw_axes(draw: Any, font: Any, px: Callable[[float, float], tuple[float, float]],
               ranges: tuple[float, float, float, float],
               box: tuple[int, int, int, int]) -> None:
    """Grid lines and tick labels (integer rounds on x), and the frame."""
    x_lo, x_hi, y_lo, y_hi = ranges
    x0, x1, y0, y1 = box
    for v in _ticks(y_lo, y_hi):
        _, y = px(x_lo, v)
        draw.line([(x0, y), (x1, y)], fill=_GRID)
        draw.text((x0 - 6, y), _label(v), fill=_INK, font=font, anchor="rm")
    for v in _ticks(x_lo, x_hi, 8):
        if abs(v - round(v)) > 1e-9:
            continue  # rounds are integers
        x, _ = px(v, y_lo)
        draw.line([(x, y0), (x, y1)], fill=_GRID)
        draw.text((x, y1 + 6), _label(v), fill=_INK, font=font, anchor="ma")
    draw.rectangle([x0, y0, x1, y1], outline=_INK)


def plot_accuracy_png(metrics_file: Path, out: Path, summary: dict[str, Any] | None = None) -> Path:
    """Test accuracy (%) per evaluated round; the calibrated accuracy as a marker when present."""
    from PIL import Image, ImageDraw, ImageFont

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line]
    xs = [float(r["round"]) for r in rows]
    ys = [100 * float(r["accuracy"]) for r in rows]
    calibrated = None
    if summary and "accuracy_before_calibration" in summary and rows:
        calibrated = (xs[-1], 100 * float(summary["accuracy"]))
    ranges = _ranges(xs, ys + ([calibrated[1]] if calibrated else []))
    x_lo, x_hi, y_lo, y_hi = ranges

    img = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    x0, x1, y0, y1 = _LEFT, _W - _RIGHT, _TOP, _H - _BOTTOM

    def px(x: float, y: float) -> tuple[float, float]:
        return (x0 + (x - x_lo) / (x_hi - x_lo) * (x1 - x0),
                y1 - (y - y_lo) / (y_hi - y_lo) * (y1 - y0))

    _draw_axes(draw, font, px, ranges, (x0, x1, y0, y1))
    points = [px(x, y) for x, y in zip(xs, ys, strict=True)]
    if len(points) > 1:
        draw.line(points, fill=_BLUE, width=2)
    for x, y in points:
        draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=_BLUE)
    legend = [("global model", _BLUE)]
    if calibrated:
        x, y = px(*calibrated)
        draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=_RED)
        legend.append((f"after {summary.get('calibrator', 'calibration')}", _RED))  # type: ignore[union-attr]
    for i, (text, color) in enumerate(reversed(legend)):
        ly = y1 - 14 - 18 * i
        draw.line([(x1 - 150, ly), (x1 - 130, ly)], fill=color, width=3)
        draw.text((x1 - 124, ly), text, fill=_INK, font=font, anchor="lm")
    title = f"{summary['method']} on {summary['dataset']}" if summary else "accuracy"
    draw.text(((x0 + x1) / 2, y0 - 10), title, fill=_INK, font=font, anchor="md")
    draw.text(((x0 + x1) / 2, _H - 8), "round", fill=_INK, font=font, anchor="md")
    ylab = Image.new("RGB", (y1 - y0, 16), "white")
    ImageDraw.Draw(ylab).text(((y1 - y0) / 2, 8), "test accuracy (%)", fill=_INK, font=font,
                              anchor="mm")
    img.paste(ylab.rotate(90, expand=True), (4, y0))
    img.save(out, format="PNG")
    return Path(out)
