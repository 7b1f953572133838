"""Plots of a run: accuracy per round, per-class accuracy before/after calibration, and the
accuracy curves of several runs overlaid (``privfedcal compare``). Style: plotstyle.py."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from privfedcal.errors import UsageError
from privfedcal.report.style.plotstyle import new_figure, save, series_style, styled


def read_metrics(metrics_file: Path) -> list[dict[str, Any]]:
    """The evaluated rounds of ``metrics.jsonl`` (empty when the file is missing); a line
    that is not JSON (a damaged or hand-edited file) is a UsageError naming it, as a damaged
    ``summary.json`` is (``report/reading.py`` ``load_json``)."""
    path = Path(metrics_file)
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path} is not valid JSON ({exc.msg}, line {number})") from None
    return [r for r in rows if isinstance(r, dict) and r.get("accuracy") is not None]


def _round_axis(ax) -> None:
    """Rounds are whole numbers: never tick 1.5."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def plot_accuracy(metrics_file: Path, out: Path, summary: dict[str, Any] | None = None) -> Path:
    """Test accuracy per evaluated round; the calibrated accuracy as a marker when present."""
    rows = read_metrics(metrics_file)
    with styled():
        fig = new_figure(5.2, 3.3)
        ax = fig.add_subplot()
        # a calibrator that re-trains the head every round (CReFF) is what the rounds evaluate
        per_round = next((r["calibration"]["name"] for r in reversed(rows)
                          if isinstance(r.get("calibration"), dict) and "name" in r["calibration"]),
                         None)
        ax.plot([r["round"] for r in rows], [100 * r["accuracy"] for r in rows],
                label=f"{per_round}'s re-trained head" if per_round else "global model",
                **series_style(0))
        if summary and "accuracy_before_calibration" in summary and rows:
            ax.scatter([rows[-1]["round"]], [100 * summary["accuracy"]], color=series_style(3)[
                "color"], marker="*", s=140, zorder=5, edgecolors="black", linewidths=0.6,
                label=f"after {summary.get('calibrator', 'calibration')}")
        _round_axis(ax)
        ax.set_ylabel("test accuracy (%)")
        title = (f"{summary.get('method', '?')} on {summary.get('dataset', '?')}" if summary
                 else "accuracy")
        ax.set_title(title)
        if rows:
            ax.legend(loc="lower right")
        return save(fig, out)


def plot_train_loss(run_dir: Path, out: Path) -> Path | None:
    """Mean local training loss per round from ``metrics.csv`` (every round), or from the
    evaluated rounds of ``metrics.jsonl`` for older run folders; None when neither has it."""
    from privfedcal.federation.runlog import read_metrics_csv

    run_dir = Path(run_dir)
    rows: list[dict[str, Any]]
    if (run_dir / "metrics.csv").is_file():
        rows = [r for r in read_metrics_csv(run_dir / "metrics.csv")
                if r.get("train_loss") is not None]
    else:
        rows = [r for r in read_metrics(run_dir / "metrics.jsonl")
                if r.get("train_loss") is not None]
    if not rows:
        return None
    with styled():
        fig = new_figure(5.2, 3.3)
        ax = fig.add_subplot()
        ax.plot([r["round"] for r in rows], [r["train_loss"] for r in rows],
                label="train loss (mean over sampled clients)",
                **series_style(1, markers=len(rows) <= 40))
        evaluated = [r for r in rows if r.get("loss") is not None]
        if evaluated:
            ax.plot([r["round"] for r in evaluated], [r["loss"] for r in evaluated],
                    label="test loss", **series_style(2, markers=len(evaluated) <= 40))
        _round_axis(ax)
        ax.set_ylabel("cross-entropy")
        ax.set_title("loss per round")
        ax.legend(loc="upper right")
        return save(fig, out)


def plot_per_class(after: Sequence[float | None], out: Path, *,
                   before: Sequence[float | None] | None = None,
                   class_names: Sequence[str] | None = None,
                   labels: tuple[str, str] = ("before calibration", "after calibration")) -> Path:
    """Per-class test accuracy: one bar per class, or two (before/after) when ``before``
    is given. Classes without test samples (None) are left empty."""
    n = len(after)
    names = [str(c) for c in class_names] if class_names and len(class_names) == n else [
        str(i) for i in range(n)]
    series = [(labels[1] if before is not None else "final model", after)]
    if before is not None:
        series.insert(0, (labels[0], before))
    many = n > 30
    with styled():
        fig = new_figure(min(max(5.0, 0.35 * n + 2), 14), 3.4)
        ax = fig.add_subplot()
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(n)]
            ys = [100 * v if v is not None else 0.0 for v in values]
            ax.bar(xs, ys, width, label=label, color=series_style(i)["color"],
                   hatch="//" if i == 0 and len(series) > 1 else None,
                   edgecolor="white" if not many else None, linewidth=0.4)
        if many:
            step = 10 if n > 60 else 5
            ax.set_xticks(range(0, n, step))
            ax.set_xlabel("class index")
        else:
            rotate = max(map(len, names), default=0) > 3
            ax.set_xticks(range(n), names, rotation=45 if rotate else 0,
                          ha="right" if rotate else "center")
            ax.set_xlabel("class")
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylim(0, 112)
        ax.set_yticks(range(0, 101, 20))
        ax.set_ylabel("test accuracy (%)")
        ax.grid(axis="x", visible=False)
        ax.legend(loc="upper center", ncol=2, frameon=False)
        return save(fig, out)


def plot_curves(curves: Mapping[str, Sequence[tuple[int, float]]], out: Path, *,
                title: str = "test accuracy per round") -> Path:
    """Accuracy curves of several runs on one axis: ``{label: [(round, accuracy), ...]}``."""
    with styled():
        fig = new_figure(7, 4)
        ax = fig.add_subplot()
        for i, (label, points) in enumerate(curves.items()):
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, [100 * y for y in ys], label=label,
                    **series_style(i, markers=len(xs) <= 40))
        _round_axis(ax)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(title)
        if curves:
            ax.legend(loc="best")
        return save(fig, out)


__all__ = ["read_metrics", "plot_accuracy", "plot_train_loss", "plot_per_class", "plot_curves"]
