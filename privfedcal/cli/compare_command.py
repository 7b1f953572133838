"""``privfedcal compare RUN_DIR...``: a table of finished runs side by side, printed and
written as ``compare.csv`` and ``compare.html`` (accuracy curves overlaid). Runs trained on
different datasets, privacy budgets or round counts are flagged, not silently compared, and
every setting that differs between the runs is named. An earlier comparison in ``--out`` is
kept unless ``--overwrite``; both files are renamed into place together
(``report/output_folder.py``). The job is ``privfedcal.jobs.compare``; this parses and prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privfedcal.cli.console import console, err_console, print_table


def compare(
    runs: Annotated[list[Path] | None, typer.Argument(help="Run folders written by privfedcal train (each may also be given as --run).", show_default=False)] = None,
    run: Annotated[list[Path] | None, typer.Option(help="A run folder; repeat for several (the same as the positional RUNS).")] = None,
    out: Annotated[Path, typer.Option(help="Folder for compare.csv and compare.html.")] = Path("runs/compare"),
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier compare.csv and compare.html in --out.")] = False,
) -> None:
    """Compare finished runs: accuracy before/after calibration, worst class, epsilon, bytes, time."""
    from rich import box
    from rich.table import Table

    from privfedcal import jobs
    from privfedcal.cli.args import run_folders
    from privfedcal.report.comparison import display_rows

    result = jobs.compare_for_cli(run_folders(runs, run), out, overwrite)
    table = Table(title="privfedcal compare", box=box.SIMPLE_HEAD)
    short = ("method", "dataset", "partition", "rounds", "before", "after", "worst", "eps",
             "bytes", "time s", "differs")
    for h in short:
        table.add_column(h, justify="left" if h in ("method", "dataset", "partition", "differs")
                         else "right", overflow="fold")
    for cells, r in zip(display_rows(result.rows), result.rows, strict=True):
        # flagged fields (not comparable), then the names of the other differing settings
        names = [d.split("=", 1)[0] for d in r["differs"].split(", ") if d]
        extra = [n for n in names if n not in ("dataset", "rounds")]
        differs = "; ".join(x for x in (r["flag"], ",".join(extra)) if x)
        table.add_row(*cells[1:-2], differs, style="yellow" if r["flags"] else None)
    print_table(table)
    for w in result.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {w}")
    if result.differing:
        console.print("settings that differ between the runs:", highlight=False)
        for line in result.differing:
            console.print(f"  {line}", highlight=False, markup=False)
    console.print(f"wrote {out / 'compare.csv'} and {out / 'compare.html'}")


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
