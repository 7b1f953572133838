"""Run an experiment with a progress bar, then print and plot its results.

When stderr is not a terminal (piped, CI, a log file) the bar is replaced by one line per
evaluated round on stderr (``--quiet``: none), and tables are printed at full width on
stdout (never truncated).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rich.table import Table

from privfedcal.cli.console import Reporter, console, err_console, print_table
from privfedcal.errors import Diverged, Interrupted
from privfedcal.experiment import build_simulator, config_of
from privfedcal.federation.checkpoint import checkpoint_round
from privfedcal.settings.run_config import RunConfig, resolved_line


def progress_line(rec: dict[str, Any], total: int) -> str:
    """The line printed (stderr) per evaluated round when stderr is not a terminal."""
    train = "withheld (DP)" if rec["train_loss"] is None else f"{rec['train_loss']:.4f}"
    return (f"round {rec['round']}/{total}: accuracy {rec['accuracy']:.4f}, test loss "
            f"{rec['loss']:.4f}, train loss {train}, {rec['seconds']:.1f} s")


def run_with_progress(sim, *, quiet: bool = False) -> dict[str, Any]:
    """Run ``sim`` to its end under a progress bar, after a line naming its resolved
    settings; returns its summary."""
    cfg = config_of(sim.exp)  # resolved: the model and its optimiser filled in
    console.print(f"privfedcal: {cfg.method} on {cfg.data.dataset}, rounds {cfg.training.rounds}, "
                  f"{resolved_line(cfg)} -> {sim.run_dir}", highlight=False, markup=False)
    for warning in sim.exp.warnings:
        err_console.print(f"privfedcal: warning: {warning}", highlight=False, markup=False)
    with Reporter(f"{cfg.method} on {cfg.data.dataset}", total=cfg.training.rounds, quiet=quiet,
                  transient=False) as progress:
        progress.update(completed=sim.start_round - 1)

        def on_round(rec: dict[str, Any]) -> None:
            acc = f"acc {rec['accuracy']:.4f}" if "accuracy" in rec else ""
            progress.update(completed=rec["round"], info=acc)
            if "accuracy" in rec:
                progress.line(progress_line(rec, cfg.training.rounds))

        summary = sim.run(progress=on_round)
    return summary


def report(summary: dict[str, Any], run_dir: Path) -> None:
    from privfedcal.report.accuracy_png import plot_accuracy_png  # no matplotlib: start-up

    plot_accuracy_png(run_dir / "metrics.jsonl", run_dir / "accuracy.png", summary)
    table = Table(title="privfedcal run")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("run folder", str(run_dir))
    table.add_row("method", f"{summary['method']} (local {summary['local_method']}, "
                  f"calibration {summary['calibrator']})")
    table.add_row("dataset", summary["dataset"])
    table.add_row("model", str(summary.get("model")))
    if "accuracy_before_calibration" in summary:
        table.add_row("accuracy before calibration", f"{summary['accuracy_before_calibration']:.4f}")
    table.add_row("accuracy", f"{summary['accuracy']:.4f}")
    pcs = [v for v in summary["per_class_accuracy"] if v is not None]
    if pcs:
        table.add_row("worst class accuracy", f"{min(pcs):.4f}")
    if "privacy" in summary:
        p = summary["privacy"]
        table.add_row("privacy", p.get("statement", ""))
    table.add_row("model updates uploaded (bytes)", f"{summary.get('model_update_bytes', 0):,}")
    table.add_row("calibration uploads (bytes)",
                  f"{summary.get('calibration_upload_bytes', summary.get('uploaded_bytes', 0)):,}")
    table.add_row("wall seconds", f"{summary['wall_seconds']:.2f}")
    print_table(table)
    for note in summary.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")


def execute(cfg: RunConfig, run_dir: Path, log: tuple[str, ...] = (),
            report_html: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Build and run ``cfg`` into ``run_dir``. A run that fails before its first checkpoint
    (bad data root, model, budget) leaves no folder behind if it made the folder."""
    created = not run_dir.exists()
    try:
        sim = build_simulator(cfg.replace(out=str(run_dir)), run_dir)
        sim.log.enable(log)  # --log tensorboard
        summary = run_with_progress(sim, quiet=quiet)
        sim.log.close()
    except Diverged:
        raise  # the folder keeps summary.json and what finished before (main says what)
    except BaseException as exc:
        if created and run_dir.is_dir() and not (run_dir / "checkpoint").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt):
            raise interrupted(run_dir) from None
        raise
    finish(summary, run_dir, report_html)
    return summary


def interrupted(run_dir: Path) -> Interrupted:
    """The one line of a stopped run: what it left and how to continue it."""
    done = checkpoint_round(run_dir) if (run_dir / "checkpoint").is_dir() else 0
    if done:
        return Interrupted(f"{run_dir} keeps the checkpoint of round {done}; continue with "
                           f"privfedcal train --resume {run_dir}")
    return Interrupted("no round had finished: nothing was kept")


def finish(summary: dict[str, Any], run_dir: Path, report_html: bool) -> None:
    report(summary, run_dir)
    if report_html:  # --report: the HTML page of privfedcal report
        from privfedcal.report.run_report import build_run_report

        console.print(f"wrote {build_run_report(run_dir)}")


def resume_run(run_dir: Path, rounds: int | None = None, threads: int | None = None,
               log: tuple[str, ...] = (), report_html: bool = False,
               quiet: bool = False) -> dict[str, Any]:
    """Continue an interrupted run, or extend a finished one to ``rounds``
    (``privfedcal.api.resume_simulator_for_cli`` checks and builds it; the API's wrapped
    ``resume_simulator`` would speak in keywords)."""
    from privfedcal.api import resume_simulator_for_cli

    sim = resume_simulator_for_cli(run_dir, rounds=rounds, threads=threads)
    sim.log.enable(log)
    try:
        summary = run_with_progress(sim, quiet=quiet)
    except KeyboardInterrupt:
        raise interrupted(run_dir) from None
    sim.log.close()
    finish(summary, run_dir, report_html)
    return summary
