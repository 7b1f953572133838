"""``privfedcal audit dp``: does the printed epsilon hold? A distinguishing game per channel of
a run configuration (the options of ``train``, or ``--run DIR``); writes ``dp_audit.csv`` and
``dp_audit.png`` (claimed vs empirical epsilon). docs/privacy/auditing.md explains the bound.
The job is ``privfedcal.jobs.audit_dp``; this parses and prints."""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from privfedcal.cli.args import run_folder
from privfedcal.cli.console import Reporter, console, err_console, print_table
from privfedcal.cli.train_command import command_options, resolve_config, setting_options
from privfedcal.errors import UsageError
from privfedcal.settings.catalogue import cli_settings

Opt = typer.Option


def _dp_options(
    config: Annotated[Path | None, Opt(help="TOML file of settings, or a run's config.json; flags override it.", rich_help_panel="Audit")] = None,
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to audit (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Audit the configuration of this run folder and write the results into it (its report shows them).", rich_help_panel="Audit")] = None,
    trials: Annotated[int, Opt(help="Releases of each of D and D' per channel (half choose the threshold, half are counted).", rich_help_panel="Audit")] = 1_000_000,
    budget_s: Annotated[float, Opt(help="Seconds per channel, one-run audits included: a channel stops when they are spent and its row, marked stopped=budget, bounds epsilon from the trials it ran.", rich_help_panel="Audit")] = 120.0,
    confidence: Annotated[float, Opt(help="Confidence of the lower bounds.", rich_help_panel="Audit")] = 0.95,
    channels: Annotated[str | None, Opt(help="Channels to audit, comma-separated: the labels of the configuration's charged releases (a calibrator's release that an attack targets, dp-sgd, dp-fedavg; an unknown name lists every channel); default: every one the configuration has.", rich_help_panel="Audit")] = None,
    one_run: Annotated[bool, Opt("--one-run/--no-one-run", help="Also audit the whole run in one run with many canaries (Steinke et al. 2023): its calibration uploads, and under --dp-train its training.", rich_help_panel="Audit")] = True,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).", rich_help_panel="Audit")] = False,
) -> None:
    """``audit dp``'s own options."""


def audit_config(run: Path | None, config: Path | None, flags: dict[str, Any]):
    """The configuration to audit: a run folder's, or the config file and flags."""
    if run is None:
        return resolve_config(config, flags)
    from privfedcal.settings.run_config import read_run_config

    given = [k for k, v in flags.items() if v is not None and k != "out"]
    if config is not None:
        given.append("config")
    if given:
        raise UsageError("--run audits the run's own settings and takes only --out; refused: "
                         + ", ".join("--" + k.replace("_", "-") for k in given))
    return read_run_config(run)


def out_dir(run: Path | None, out: str | None) -> Path:
    if out:
        return Path(out)
    if run is not None:
        return Path(run)
    return Path("runs") / f"dp-audit-{time.strftime('%Y%m%d-%H%M%S')}"


def _row_line(row: dict[str, Any]) -> str:
    """One channel's result, as the log line printed when it is done."""
    count = (f"{row['trials']:,} trials" if row["trials"] > 1 else row["canary"])
    stop = ", stopped by its time budget" if row.get("stopped") else ""
    return (f"{row['channel']}: {count} in {row['seconds']:.1f} s{stop}, eps_lower "
            f"{row['eps_lower']:.3f} (claimed {row['claimed_eps']:.3f})")


# Its options, one per declared setting, are assembled when click builds the command (below);
# cli/command_signatures.py writes them out as a plain signature.
def dp(**flags: Any) -> None:
    """Empirical lower bounds on epsilon, one per channel, beside the epsilon the run claims."""
    from rich.table import Table

    from privfedcal import jobs
    from privfedcal.attacks.distinguishing.channels import parse_channels
    from privfedcal.attacks.distinguishing.games import CSV_NAME, PNG_NAME

    config, run_dir, run, trials, budget_s, confidence, channels, whole, quiet = (
        flags.pop(k) for k in ("config", "run_dir", "run", "trials", "budget_s", "confidence",
                               "channels", "one_run", "quiet"))
    run = run_folder(run_dir, run, "audit dp", required=False)
    if run is not None and not Path(run).is_dir():
        raise UsageError(f"--run {run}: no such run folder")
    names = parse_channels(channels)
    cfg = audit_config(run, config, flags)
    target = out_dir(run, flags.get("out"))
    with Reporter("audit dp", quiet=quiet, announce=False) as progress:
        rows = jobs.audit_dp_for_cli(
            cfg, target, trials=trials, budget_s=budget_s, confidence=confidence,
            channels=names, one_run=whole,
            progress=lambda s: progress.update(description=f"audit dp: {s.description}",
                                               completed=s.done, total=s.total),
            on_row=lambda row: progress.line(_row_line(row))).rows
    table = Table(title=f"privfedcal audit dp: {target}")
    for col in ("channel", "claimed eps", "delta", f"eps lower ({100 * confidence:g}%)",
                "trials", "score", "seconds", "verdict"):
        table.add_column(col, justify="left" if col in ("channel", "score", "verdict") else "right")
    for r in rows:
        refuted = r["eps_lower"] > r["claimed_eps"]
        verdict = "CLAIM REFUTED" if refuted else "consistent with the claim"
        table.add_row(r["channel"], f"{r['claimed_eps']:.3f}", f"{r['delta']:.2g}",
                      f"{r['eps_lower']:.3f}", f"{r['trials']:,}", r["score"],
                      f"{r['seconds']:.1f}",
                      verdict + (" (stopped by its time budget)" if r.get("stopped") else ""))
    print_table(table)
    for r in rows:
        if r["eps_lower"] > r["claimed_eps"]:
            err_console.print(f"privfedcal: warning: {r['channel']}: the empirical lower bound "
                              f"{r['eps_lower']:.3f} exceeds the claimed epsilon "
                              f"{r['claimed_eps']:.3f} (confidence {confidence:g})",
                              highlight=False, markup=False)
    console.print(f"wrote {CSV_NAME} and {PNG_NAME} into {target}")


# The options are the run settings of ``train`` plus ``_dp_options``.
dp.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    setting_options(cli_settings()) + command_options(_dp_options))


def register(group: typer.Typer) -> None:
    group.command("dp")(dp)
