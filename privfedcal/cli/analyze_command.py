"""``privfedcal analyze RUN_DIR``: classifier norms, singular values, client CKA per layer and
GMM separability of a finished run (CCVR, Luo et al. 2021, figs. 1-3 and 6), written into the
run folder as PNGs plus ``analysis.json``. The job is ``privfedcal.jobs.analyze``; this parses
and prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from privfedcal.cli.console import Reporter, console, print_table


def _fmt(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.4f}"


def summary_table(result: dict[str, Any]) -> Table:
    """A short table of the headline numbers of an ``analysis.json`` dict."""
    cls = result["classifier"]
    table = Table(title=f"privfedcal analysis: {result['run_dir']}")
    table.add_column("quantity")
    table.add_column("global (checkpoint)", justify="right")
    table.add_column("final", justify="right")
    ratios = [max(v) / min(v) if min(v) > 0 else float("inf")
              for v in (cls["norms"]["before"], cls["norms"]["after"])]
    table.add_row("max / min class norm", *(f"{r:.3f}" for r in ratios))
    sv = cls["singular_values"]
    table.add_row("largest / smallest singular value",
                  f"{sv['before'][0]:.3f} / {sv['before'][-1]:.3f}",
                  f"{sv['after'][0]:.3f} / {sv['after'][-1]:.3f}")
    for layer, value in result["cka"]["mean"].items():
        table.add_row(f"mean client CKA, {layer}", "", _fmt(value))
    sep = result["separability"]
    table.add_row(f"mean sliced W2 between classes ({sep['projections']} dirs)", "",
                  f"{sep['mean_sliced_wasserstein']:.4f}")
    return table


def analyze(
    run_dir: Annotated[Path | None, typer.Argument(help="A run folder written by privfedcal train (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, typer.Option(help="The run folder (the same as the positional RUN_DIR).")] = None,
    samples: Annotated[int, typer.Option(help="Test images on which client models are compared (CKA).")] = 500,
    projections: Annotated[int, typer.Option(help="Random directions of the sliced Wasserstein distance.")] = 256,
    max_clients: Annotated[int | None, typer.Option(help="Retrain and compare only the first N clients (default: all).")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda (default: the run's).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """Classifier norms and singular values before/after calibration, client CKA per layer
    and class separability of a finished run."""
    from privfedcal import jobs
    from privfedcal.cli.args import run_folder

    run_dir = run_folder(run_dir, run, "analyze", required=True)
    assert run_dir is not None
    # the run is checked while it loads: no line before a usage error
    with Reporter(f"analyze {run_dir}: loading the run", quiet=quiet,
                  announce=False) as progress:
        result = jobs.analyze_for_cli(run_dir, samples=samples, projections=projections,
                                      max_clients=max_clients, device=device,
                                      progress=lambda s: progress.update(
                                          description=f"analyze {run_dir}: {s.description}",
                                          completed=s.done, total=s.total))
    print_table(summary_table(result))
    note = result["classifier"].get("note")
    if note:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"wrote {', '.join(result['plots'])} and analysis.json into {run_dir}")


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze)
