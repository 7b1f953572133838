"""Self-contained HTML reports of runs, audits and comparisons (docs/report.md)."""

from privfedcal.report.run_report import build_run_report

__all__ = ["build_run_report"]
