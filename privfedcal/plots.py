"""Plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_accuracy(metrics_file: Path, out: Path, summary: dict[str, Any] | None = None) -> Path:
    """Test accuracy per evaluated round; the calibrated accuracy as a marker when present."""
    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["round"] for r in rows], [100 * r["accuracy"] for r in rows], marker=".",
            label="global model")
    if summary and "accuracy_before_calibration" in summary and rows:
        ax.scatter([rows[-1]["round"]], [100 * summary["accuracy"]], color="C3", zorder=3,
                   label=f"after {summary.get('calibrator', 'calibration')}")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    title = f"{summary['method']} on {summary['dataset']}" if summary else "accuracy"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
