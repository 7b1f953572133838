"""Self-contained HTML reports of runs, audits and comparisons (docs/report.md), and the
figures they show (run_plots.py, accuracy_png.py; the shared look in style/).

``build_run_report`` is imported on first use, so that the floors below the report can use
``report.style`` without loading the report's own modules."""

from __future__ import annotations

from typing import Any

__all__ = ["build_run_report"]


def __getattr__(name: str) -> Any:
    if name == "build_run_report":
        from privfedcal.report.run_report import build_run_report

        return build_run_report
    raise AttributeError(f"module 'privfedcal.report' has no attribute {name!r}")
