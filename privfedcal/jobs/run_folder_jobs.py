"""The jobs that read finished run folders: ``compare`` (runs side by side), ``analyze``
(a run's classifier and representations) and ``write_report`` (a run's or an audit's page);
the heavy code is in ``report/`` and ``analysis/run_analysis.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfedcal.api import Run
from privfedcal.errors import UsageError
from privfedcal.jobs.job_surface import JobStep, Watch, job, report_step, run_path
from privfedcal.report.output_folder import all_or_nothing, check_fresh, check_writable

COMPARE_FILES = ("compare.csv", "compare.html")


@dataclass(frozen=True)
class Comparison:
    """``compare``'s result: one row per run (``compare.csv``'s columns,
    ``report/comparison.py`` ``COLUMNS``, with ``budget``, ``flag`` and ``curve``: the
    (round, accuracy) of each evaluated round), the warnings of runs that are not
    comparable, one line per setting that differs between the runs, and the files written
    (None: none)."""

    rows: list[dict[str, Any]]
    warnings: list[str]
    differing: list[str]
    csv: Path | None = None
    html: Path | None = None


# ---- compare ----------------------------------------------------------------------------------

def compare_for_cli(runs: list[Path], out: Path | None = None,
                    overwrite: bool = False) -> Comparison:
    """``privfedcal compare``: the runs' rows, written to ``out`` when given (an earlier
    comparison there is kept unless ``overwrite``; both files or neither)."""
    from privfedcal.report import comparison as comparing

    if not runs:
        raise UsageError("compare needs at least one run folder: privfedcal compare RUN... "
                         "(or --run RUN, repeated)")
    if out is not None:
        check_fresh(out, COMPARE_FILES, overwrite=overwrite, what="a comparison")
    rows, warnings = comparing.collect(runs)
    differing = comparing.differing_settings([dict(r, differs="") for r in rows])
    # the rows as returned: the writers' private keys left out, the accuracy curve kept
    shown = [{**{k: v for k, v in r.items() if not k.startswith("_")}, "curve": r["_curve"]}
             for r in rows]
    if out is None:
        return Comparison(shown, warnings, differing)
    with all_or_nothing(out, COMPARE_FILES) as paths:
        comparing.write_csv(rows, paths["compare.csv"])
        comparing.write_html(rows, warnings, paths["compare.html"])
    return Comparison(shown, warnings, differing, out / "compare.csv", out / "compare.html")


@job
def compare(runs: Iterable[Run | str | Path], *, out: str | Path | None = None,
            overwrite: bool = False) -> Comparison:
    """Finished runs side by side, as ``privfedcal compare``: accuracy before and after
    calibration, worst class, epsilon, bytes, time; runs on different datasets, budgets or
    round counts flagged (``warnings``), and every setting that differs named
    (``differing``). Writes ``compare.csv`` and ``compare.html`` into ``out`` only when
    ``out`` is given (an earlier comparison there is kept unless ``overwrite=True``)."""
    paths = list(dict.fromkeys(run_path(r) for r in runs))
    if not paths:
        raise UsageError("compare needs at least one run in runs")
    return compare_for_cli(paths, None if out is None else Path(out), overwrite)


# ---- analyze ----------------------------------------------------------------------------------

def analyze_for_cli(run_dir: Path, *, samples: int = 500, projections: int = 256,
                    max_clients: int | None = None, device: str | None = None, write: bool = True,
                    progress: Callable[[JobStep], None] | None = None) -> dict[str, Any]:
    """``privfedcal analyze``: ``analysis.json``'s dict; with ``write``, it and the PNGs are
    written into the run folder."""
    from privfedcal.analysis.run_analysis import AnalysisOptions, analyze_run

    options = AnalysisOptions(samples=samples, projections=projections,
                              max_clients=max_clients, device=device)
    what, count = "retraining clients for CKA", {"done": 0, "total": 0}

    def on_start(k: int) -> None:
        count["total"] = k
        report_step(progress, JobStep(what, 0, k))

    def on_client(_c: int) -> None:
        count["done"] += 1
        report_step(progress, JobStep(what, count["done"], count["total"]))

    return analyze_run(run_dir, options, on_start=on_start, on_client=on_client, write=write)


@job
def analyze(run: Run | str | Path, *, samples: int = 500, projections: int = 256,
            max_clients: int | None = None, device: str | None = None, write: bool = True,
            progress: bool | Callable[[JobStep], None] | None = None) -> dict[str, Any]:
    """Classifier norms and singular values before and after calibration, client CKA per
    layer and class separability of a finished run, as ``privfedcal analyze`` (CCVR, Luo et
    al. 2021, figs. 1-3 and 6): the ``analysis.json`` dict. Like the command it writes
    ``analysis.json`` and its PNGs into the run folder; ``write=False`` writes nothing.
    ``progress``: a bar over the clients retrained for CKA when interactive (None), always
    (True) or never (False), or a callable given a ``JobStep`` per client."""
    with Watch(progress, "analyze") as watch:
        return analyze_for_cli(run_path(run), samples=samples, projections=projections,
                               max_clients=max_clients, device=device, write=write, progress=watch)




# ---- report -----------------------------------------------------------------------------------

def page_path(folder: Path, out: Path | None) -> Path:
    """The page ``report`` writes: ``out`` ending in .html is its path, any other ``out`` a
    folder (made if needed) that gets ``report.html``; without ``out``, FOLDER/report.html."""
    if out is None:
        return folder / "report.html"
    return out if out.suffix.lower() in (".html", ".htm") else out / "report.html"


def write_report_for_cli(folder: Path, out: Path | None = None) -> Path:
    """``privfedcal report``: the page of a run folder (summary.json) or of an audit folder
    (audit.csv), written where ``page_path`` says; returns its path."""
    from privfedcal.report.audit_report import build_audit_report
    from privfedcal.report.run_report import build_run_report

    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    page = page_path(folder, out)
    check_writable(page.parent)
    if page.is_dir():
        raise UsageError(f"cannot write the report to {page}: it is a folder")
    if (folder / "audit.csv").is_file():
        return Path(build_audit_report(folder, page))
    if (folder / "summary.json").is_file() or (folder / "config.json").is_file():
        return Path(build_run_report(folder, page))
    raise UsageError(f"{folder} holds neither a run (summary.json) nor an audit (audit.csv)")


@job
def write_report(folder: Run | str | Path, *, out: str | Path | None = None) -> Path:
    """One self-contained HTML page of a run folder or an audit folder (``audit``'s ``out``),
    as ``privfedcal report``: plots, tables, the privacy ledger; it opens from disk with no
    network. Written, as by the command, to ``FOLDER/report.html``, or to ``out`` (a path
    ending in .html, or a folder that gets ``report.html``); returns the page's path."""
    return write_report_for_cli(run_path(folder), None if out is None else Path(out))
