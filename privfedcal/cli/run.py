"""Run an experiment with a progress bar, then print and plot its results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from privfedcal.config import RunConfig
from privfedcal.errors import UsageError

console = Console()
err_console = Console(stderr=True)


def build_simulator(cfg: RunConfig, run_dir: Path):
    from privfedcal.federation.setup import build_experiment
    from privfedcal.federation.simulator import Simulator
    from privfedcal.privacy.uplink import build_uplink

    exp = build_experiment(cfg)
    calibrator = build_calibrator(cfg, exp)
    uplink = build_uplink(cfg, exp)
    return Simulator(cfg, run_dir, calibrator=calibrator, uplink=uplink, exp=exp)


def build_calibrator(cfg: RunConfig, exp):
    from privfedcal.calibration import create_calibrator
    from privfedcal.federation.hooks import CalibrationSpec

    name, _, arg = cfg.calibrator.partition(":")
    if arg and not arg.isdigit():
        raise UsageError(f"--calibrate {cfg.calibrator!r}: the argument after ':' must be an integer")
    spec = CalibrationSpec(name=name, arg=int(arg) if arg else None)
    return create_calibrator(spec, num_classes=exp.data.num_classes,
                             feature_dim=exp.model.feature_dim,
                             options={**cfg.calibration_params, "seed": cfg.seed})


def run_with_progress(sim, cfg: RunConfig) -> dict[str, Any]:
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[acc]}"),
                        TimeElapsedColumn(), console=err_console, transient=False,
                        disable=not err_console.is_terminal)
    with progress:
        task = progress.add_task(f"{cfg.method} on {cfg.dataset}", total=cfg.rounds,
                                 completed=sim.start_round - 1, acc="")

        def on_round(rec: dict[str, Any]) -> None:
            acc = f"acc {rec['accuracy']:.4f}" if "accuracy" in rec else ""
            progress.update(task, completed=rec["round"], acc=acc)

        summary = sim.run(progress=on_round)
    return summary


def report(summary: dict[str, Any], run_dir: Path) -> None:
    from privfedcal.plots import plot_accuracy

    plot_accuracy(run_dir / "metrics.jsonl", run_dir / "accuracy.png", summary)
    table = Table(title=f"privfedcal run: {run_dir}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("method", f"{summary['method']} (local {summary['local_method']}, "
                  f"calibration {summary['calibrator']})")
    table.add_row("dataset", summary["dataset"])
    if "accuracy_before_calibration" in summary:
        table.add_row("accuracy before calibration", f"{summary['accuracy_before_calibration']:.4f}")
    table.add_row("accuracy", f"{summary['accuracy']:.4f}")
    pcs = [v for v in summary["per_class_accuracy"] if v is not None]
    if pcs:
        table.add_row("worst class accuracy", f"{min(pcs):.4f}")
    if "privacy" in summary:
        p = summary["privacy"]
        table.add_row("privacy", p.get("statement", ""))
    table.add_row("uploaded bytes", f"{summary.get('uploaded_bytes', 0):,}")
    table.add_row("wall seconds", f"{summary['wall_seconds']:.2f}")
    console.print(table)
    for note in summary.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")


def execute(cfg: RunConfig, run_dir: Path, log: tuple[str, ...] = (),
            report_html: bool = False) -> dict[str, Any]:
    sim = build_simulator(cfg, run_dir)
    sim.log.enable(log)  # --log tensorboard
    summary = run_with_progress(sim, cfg)
    sim.log.close()
    finish(summary, run_dir, report_html)
    return summary


def finish(summary: dict[str, Any], run_dir: Path, report_html: bool) -> None:
    report(summary, run_dir)
    if report_html:  # --report: the HTML page of privfedcal report
        from privfedcal.report.run import build_run_report

        console.print(f"wrote {build_run_report(run_dir)}")


def resume_run(run_dir: Path, log: tuple[str, ...] = (), report_html: bool = False
               ) -> dict[str, Any]:
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise UsageError(f"{run_dir} is not a run folder (no config.json)")
    raw = json.loads(cfg_file.read_text())
    raw.pop("versions", None)
    cfg = RunConfig.from_dict(raw)
    sim = build_simulator(cfg, run_dir)
    if (run_dir / "checkpoint").exists():
        sim.restore()
    if sim.start_round > cfg.rounds and (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} is already complete (see summary.json)")
    sim.log.enable(log)
    summary = run_with_progress(sim, cfg)
    sim.log.close()
    finish(summary, run_dir, report_html)
    return summary
