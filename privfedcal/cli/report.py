"""``privfedcal report DIR``: one self-contained ``report.html`` of a run folder (written by
``privfedcal train``) or of an audit folder (written by ``privfedcal audit``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privfedcal.errors import UsageError


def report(
    folder: Annotated[Path | None, typer.Argument(help="A run folder (summary.json) or an audit folder (audit.csv); the same as --run.", show_default=False)] = None,
    run: Annotated[Path | None, typer.Option(help="The folder (the same as the positional FOLDER).")] = None,
    out: Annotated[Path | None, typer.Option(help="Where to write the page: a path ending in .html, or a folder that gets report.html (default FOLDER/report.html).")] = None,
) -> None:
    """Write FOLDER/report.html: plots, tables, privacy ledger; opens from disk, no network."""
    from privfedcal.cli.args import run_folder
    from privfedcal.cli.output import check_writable
    from privfedcal.report.audit import build_audit_report
    from privfedcal.report.run import build_run_report

    folder = run_folder(folder, run, "report", required=True)
    assert folder is not None
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    page = page_path(folder, out)
    check_writable(page.parent)
    if page.is_dir():
        raise UsageError(f"cannot write the report to {page}: it is a folder")
    if (folder / "audit.csv").is_file():
        path = build_audit_report(folder, page)
    elif (folder / "summary.json").is_file() or (folder / "config.json").is_file():
        path = build_run_report(folder, page)
    else:
        raise UsageError(f"{folder} holds neither a run (summary.json) nor an audit (audit.csv)")
    print(f"wrote {path}")


def page_path(folder: Path, out: Path | None) -> Path:
    """The page ``report`` writes: ``--out`` ending in .html is its path, any other ``--out``
    a folder (made if needed) that gets ``report.html``, as ``--out`` is a folder elsewhere."""
    if out is None:
        return folder / "report.html"
    return out if out.suffix.lower() in (".html", ".htm") else out / "report.html"


def register(app: typer.Typer) -> None:
    app.command("report")(report)
