"""``privfedcal report DIR``: one self-contained ``report.html`` of a run folder (written by
``privfedcal train``) or of an audit folder (written by ``privfedcal audit``). The job is
``privfedcal.jobs.write_report``; this parses and prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def report(
    folder: Annotated[Path | None, typer.Argument(help="A run folder (summary.json) or an audit folder (audit.csv); the same as --run.", show_default=False)] = None,
    run: Annotated[Path | None, typer.Option(help="The folder (the same as the positional FOLDER).")] = None,
    out: Annotated[Path | None, typer.Option(help="Where to write the page: a path ending in .html, or a folder that gets report.html (default FOLDER/report.html).")] = None,
) -> None:
    """Write FOLDER/report.html: plots, tables, privacy ledger; opens from disk, no network."""
    from privfedcal import jobs
    from privfedcal.cli.args import run_folder

    folder = run_folder(folder, run, "report", required=True)
    assert folder is not None
    print(f"wrote {jobs.write_report_for_cli(folder, out)}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
