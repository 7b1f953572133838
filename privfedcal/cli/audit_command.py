"""``privfedcal audit``: train and attack every protection setting of a grid; write
``audit.csv`` (one row per setting) and ``audit.png`` (accuracy vs attack success).

``audit`` is a command group: without a sub-command it runs this reconstruction sweep (its
options are the group's), and ``audit dp`` runs the distinguishing games of
``cli/audit_dp_command.py`` (docs/privacy/auditing.md puts the two side by side). The jobs are
``privfedcal.jobs.audit`` and ``audit_dp``; these commands parse and print."""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from privfedcal.cli.attack_flags import option_parameters
from privfedcal.cli.console import console, print_table
from privfedcal.cli.train_command import command_options
from privfedcal.errors import UsageError

Opt = typer.Option

_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def parse_eps(text: str) -> tuple[float, ...]:
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = float(item)
        except ValueError:
            raise UsageError(f"--eps takes numbers or inf, got {item!r}") from None
        if math.isnan(value) or value <= 0:
            raise UsageError(f"--eps values must be > 0 (inf = no DP), got {item!r}")
        out.append(value)
    if not out:
        raise UsageError("--eps needs at least one value")
    return tuple(dict.fromkeys(out))


def parse_secagg(text: str) -> tuple[bool, ...]:
    out = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        if item not in _ON + _OFF:
            raise UsageError(f"--secagg takes off and/or on, got {item!r}")
        out.append(item in _ON)
    if not out:
        raise UsageError("--secagg needs at least one of off, on")
    return tuple(dict.fromkeys(out))


def parse_methods(text: str | None) -> tuple[str, ...]:
    """``--methods``; not given: every calibrator whose release a registered attack
    targets (``release_attacks.attacked_calibrators``: ccvr, creff)."""
    from privfedcal.attacks.release_attacks import attacked_calibrators
    from privfedcal.jobs import check_methods

    if text is None:
        return check_methods(attacked_calibrators())
    return check_methods(t.strip() for t in text.split(",") if t.strip())


def _fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else "-" if math.isnan(value) else f"{value:.{digits}f}"
    return "-" if value is None else str(value)


def _audit_options(
    ctx: typer.Context,
    eps: Annotated[str, Opt(help="Comma-separated total epsilons; inf = no DP.")] = "1,2,4,8,inf",
    secagg: Annotated[str, Opt(help="Secure aggregation settings: off,on.")] = "off,on",
    methods: Annotated[str | None, Opt(help="Methods to audit, comma-separated (default: every calibrator whose release a registered attack targets: ccvr, creff).", show_default=False)] = None,
    rounds: Annotated[int, Opt(help="Communication rounds per run.")] = 5,
    participation: Annotated[float, Opt(help="Fraction of clients per round (below 1, secure sums change between rounds: see the disaggregation columns).")] = 1.0,
    clients: Annotated[int, Opt(help="Clients in each federation.")] = 5,
    attack_clients: Annotated[int, Opt(help="Clients whose uploads are inverted.")] = 1,
    dataset: Annotated[str, Opt(help="Dataset of the runs.")] = "digits",
    seed: Annotated[int, Opt(help="Seed of runs and attacks.")] = 0,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    out: Annotated[Path | None, Opt(help="Output folder (default runs/audit-<time>).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier audit in --out.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """``audit``'s own options; its inversion options (``--steps``, ``--restarts``,
    ``--attack-batch``) are the attacks' options fields (``inversion_options.audit_flags``)."""


def audit_command() -> Any:
    """The audit's callback: its own options, then the inversion options' flags, built from
    ``InversionOptions``' fields with the audit's defaults (``inversion_options.AUDIT_DEFAULTS``).
    Written out in ``cli/command_signatures.py`` (``audit``)."""
    from privfedcal.attacks.reconstruction.inversion_options import audit_flags

    def audit(**flags: Any) -> None:
        """Sweep DP epsilon x secure aggregation x method: train, attack, tabulate, plot.

        `privfedcal audit dp` instead measures a lower bound on epsilon per channel."""
        run_audit(flags)

    audit.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        command_options(_audit_options) + option_parameters(audit_flags()))
    return audit


def run_audit(flags: dict[str, Any]) -> None:
    """``privfedcal audit`` with the given flags (an inversion option not given: the
    audit's default, ``AuditConfig``'s)."""
    if flags["ctx"].invoked_subcommand is not None:
        return  # `audit dp ...`: the group's own sweep does not run
    from privfedcal import jobs
    from privfedcal.attacks.reconstruction.inversion_options import AUDIT_INVERSION_OPTIONS
    from privfedcal.attacks.reconstruction.leakage_sweep import AuditConfig, Setting
    from privfedcal.cli.console import Reporter

    inversion = {n: flags[n] for n in AUDIT_INVERSION_OPTIONS if flags[n] is not None}
    config = AuditConfig(eps=parse_eps(flags["eps"]), secagg=parse_secagg(flags["secagg"]),
                         methods=parse_methods(flags["methods"]), dataset=flags["dataset"],
                         clients=flags["clients"], rounds=flags["rounds"],
                         participation=flags["participation"],
                         attack_clients=flags["attack_clients"], seed=flags["seed"],
                         device=flags["device"], **inversion)
    out, overwrite, quiet = flags["out"], flags["overwrite"], flags["quiet"]
    out_dir = out or Path("runs") / f"audit-{time.strftime('%Y%m%d-%H%M%S')}"
    # no line before the job's checks pass: its first stage (no description) is the start
    with Reporter("", total=len(config.settings()), quiet=quiet, announce=False) as bar:
        rows = jobs.audit_for_cli(config, out_dir, overwrite=overwrite,
                                  progress=lambda s: bar.update(
                                      description=f"audit {s.description}".strip(),
                                      completed=s.done, total=s.total)).rows
    table = Table(title=f"privfedcal audit: {out_dir}")
    for col in ("method", "eps", "secagg", "acc", "max PSNR", "NN@max", "worst",
                "prior max", "PSNR", "prior", "SSIM", "class inf", "disagg", "finest",
                "eps spent", "eps held"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        nn_worst = r.get("nearest_of_worst")
        worst = ("-" if r.get("worst_target") is None else
                 f"k{r['worst_client']}/c{r['worst_class']} {r['worst_target']}")
        table.add_row(r["method"], _fmt(r["eps"], 2), "on" if r["secagg"] else "off",
                      _fmt(r.get("accuracy")), _fmt(r.get("psnr_max"), 2),
                      "-" if nn_worst is None else ("yes" if nn_worst else "no"), worst,
                      *(_fmt(r.get(k), 2 if "psnr" in k else 3) for k in
                        ("prior_psnr_max", "psnr", "prior_psnr", "ssim",
                         "class_inference_accuracy")),
                      _fmt(r.get("disaggregated")), _fmt(r.get("finest_group")),
                      _fmt(r.get("epsilon_spent"), 3),
                      _fmt(r.get("epsilon_from_transcript"), 3))
    print_table(table)
    for r in rows:
        if r["note"]:
            console.print(f"[yellow]note:[/yellow] {Setting(r['method'], r['eps'], r['secagg']).name}: "
                          f"{r['note']}")
    console.print(f"wrote audit.csv and audit.png into {out_dir}")


def register(app: typer.Typer) -> None:
    from privfedcal.cli import audit_dp_command as audit_dp

    group = typer.Typer(name="audit", no_args_is_help=False, add_completion=False,
                        pretty_exceptions_enable=False)
    group.callback(invoke_without_command=True)(audit_command())
    audit_dp.register(group)
    app.add_typer(group, name="audit")
