"""``privfedcal compare RUN_DIR...``: a table of finished runs side by side, printed and
written as ``compare.csv`` and ``compare.html`` (accuracy curves overlaid). Runs trained on
different datasets or under different privacy budgets are flagged, not silently compared."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privfedcal.cli.console import console, err_console
from privfedcal.errors import UsageError


def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run folders written by privfedcal train.")],
    out: Annotated[Path, typer.Option(help="Folder for compare.csv and compare.html.")] = Path("runs/compare"),
) -> None:
    """Compare finished runs: accuracy before/after calibration, worst class, epsilon, bytes, time."""
    from rich import box
    from rich.table import Table

    from privfedcal.report.compare import (
        collect,
        display_rows,
        write_csv,
        write_html,
    )

    if len(runs) < 1:
        raise UsageError("give at least one run folder")
    rows, warnings = collect(runs)
    table = Table(title="privfedcal compare", box=box.SIMPLE_HEAD)
    short = ("method", "dataset", "partition", "rounds", "before", "after", "worst", "eps",
             "bytes", "time s", "differs")
    for h in short:
        table.add_column(h, justify="left" if h in ("method", "dataset", "partition", "differs")
                         else "right", overflow="fold")
    for cells, r in zip(display_rows(rows), rows, strict=True):
        table.add_row(*cells[1:-1], r["flag"], style="yellow" if r["flags"] else None)
    console.print(table)
    for w in warnings:
        err_console.print(f"[yellow]warning:[/yellow] {w}")
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "compare.csv")
    write_html(rows, warnings, out / "compare.html")
    console.print(f"wrote {out / 'compare.csv'} and {out / 'compare.html'}")


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
