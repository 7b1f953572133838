"""``privfedcal attack``: attack what the server observed in a run, one command per kind.

The commands come from the attack registry (``attacks/release_attacks.py``) when click asks
for them, so an attack registered by an imported module is there too: ``invert`` takes one
flag per registered attack with a planner (``--stats`` inverts CCVR uploads, ``--gradients``
CReFF class gradients, ``--updates`` the per-client model updates, alone or with the attack
it joins) and the options of the chosen attacks (each attack's options type: its fields
are the flags); every registered attack on the run as a whole is a command of its own
(``disaggregate`` differences the secure sums of a run into per-client values); ``classes``
infers every client's class set. Without ``--run`` a quick default run on digits is
trained first (``invert``, ``classes``), with the calibrator whose release the chosen
attack targets. Outputs go to ``--out`` (default RUN_DIR/attack-<kind>/): ``attack.json``,
a PNG, and a summary table on stdout. Earlier results there are kept unless
``--overwrite``; the files are renamed into place together at the end, so a failed attack
leaves nothing half-written. Progress (a bar, or lines on stderr when piped) counts
optimisation steps x restarts with an ETA (``runner.execute``'s ``Progress``). Ctrl-C or
SIGTERM during ``invert`` writes the finished targets as a partial attack.json
(``attacks/reconstruction/resume.py``) and exits 130; the same command with ``--resume``
runs the other targets only. The jobs are ``privfedcal/api/attack_jobs.py``; these commands
parse their flags, call them and print what they return.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from privfedcal.cli.args import run_folder
from privfedcal.cli.attack_flags import (
    given_options,
    option_parameters,
    options_given,
    refuse_strays,
)
from privfedcal.cli.attack_whole_command import (
    print_notes,
    run_attack_command,
    set_threads,
)
from privfedcal.cli.console import Reporter, console, print_table
from privfedcal.cli.train_command import command_options
from privfedcal.errors import UsageError

Opt = typer.Option
KEYWORD = inspect.Parameter.KEYWORD_ONLY

class AttackGroup(TyperGroup):
    """``privfedcal attack``'s commands: ``classes``, and, built from the attack registry
    when click asks for them, ``invert`` and one command per attack on the run as a whole."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from privfedcal.attacks.release_attacks import run_attacks

        return ["invert", "classes", *(a.name for a in run_attacks())]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        from privfedcal.attacks.release_attacks import release_attack, run_attacks

        if name == "invert":
            return _click(name, invert_command())
        if name == "classes":
            return _click(name, classes_command())
        if name in {a.name for a in run_attacks()}:
            return _click(name, run_attack_command(release_attack(name)))
        return super().get_command(ctx, name)


attack_app = typer.Typer(cls=AttackGroup, no_args_is_help=True,
                         help="Attack what an honest-but-curious server observed in a run.")


def _click(name: str, func: Any) -> click.Command:
    """The click command typer makes of ``func``."""
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command(name)(func)
    return typer.main.get_command(one)


def _offered() -> list[Any]:
    from privfedcal.attacks.release_attacks import plan_attacks

    return plan_attacks()


def parse_ints(text: str | None, flag: str) -> list[int] | None:
    """``"0,3"`` -> [0, 3]; None stays None."""
    if text is None:
        return None
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise UsageError(f"{flag} takes comma-separated integers >= 0, got {text!r}")
    return values


def clock(seconds: float | None) -> str:
    """``1:05:09``, ``4:09``; ``?`` for None."""
    if seconds is None:
        return "?"
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def show_progress(progress: Reporter, kind: str, p) -> None:
    """``execute``'s ``Progress`` on the bar (or log lines): optimisation steps of the
    planned total, targets done, ETA; a new line per batch. Until a target has stopped the
    ETA is the time to every step cap (``<=``); after, scaled by how far below the cap
    targets stopped (``~``, ``Progress.eta``)."""
    bound = "" if p.eta is None else "~" if p.stop_share is not None else "<= "
    progress.update(description=f"attack {kind}: {p.running or 'done'}",
                    completed=p.steps, total=max(p.total, 1),
                    info=f"steps x restarts, {p.targets}/{p.of} targets, "
                         f"ETA {bound}{clock(p.eta)}")


class ConsoleShown:
    """What ``privfedcal attack`` shows while its job runs (``api.attack_jobs.Shown``): lines
    on the console, the quick run's rounds as ``train`` shows them, and a bar (or lines on
    stderr) over the inversions' steps, or over the inference of the class sets."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def say(self, line: str) -> None:
        console.print(line)

    def train(self, sim: Any) -> dict[str, Any]:
        from privfedcal.cli.run_progress import run_with_progress

        return run_with_progress(sim, quiet=self.quiet)

    @contextmanager
    def progress(self, kind: str) -> Iterator[Callable[[Any], None]]:
        if kind == "classes":
            with Reporter("attack classes: inferring every client's class set",
                          quiet=self.quiet):
                yield lambda p: None
            return
        with Reporter(f"attack {kind}: planning", total=1, quiet=self.quiet) as bar:
            yield lambda p: show_progress(bar, kind, p)


def _invert_options(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack (default: train a quick digits run).")] = None,
    clients: Annotated[str | None, Opt(help="Client ids to attack, e.g. 0,3 (default: the first two).")] = None,
    classes: Annotated[str | None, Opt(help="Classes to attack, e.g. 1,7 (default: all present).")] = None,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-<kind>).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
    resume: Annotated[bool, Opt("--resume", help="Finish an interrupted attack in the output folder (same settings): only the targets its partial attack.json lacks are run.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """``invert``'s own options; the attack flags and their options come from the registry."""


def invert_command() -> Any:
    """``attack invert``: a flag per registered attack with a planner (its ``summary`` the
    help), then the options of every one of them (their options types' CLI fields).
    Written out in ``cli/command_signatures.py`` (``attack_invert``; kept in step by its
    test)."""
    from privfedcal.attacks.attack_options import merged_flags

    attacks = _offered()
    offered = merged_flags(a.options for a in attacks)

    def invert(**flags: Any) -> None:
        """Reconstruct client images from what the server saw; score them against the truth."""
        run_invert(attacks, offered, flags)

    selectors = [inspect.Parameter(a.name, KEYWORD, default=False, annotation=Annotated[
        bool, Opt(f"--{a.name}", help=a.summary, rich_help_panel="Attacks")]) for a in attacks]
    invert.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        selectors + command_options(_invert_options) + option_parameters(offered.values()))
    return invert


def run_invert(attacks: list[Any], offered: dict[str, Any], flags: dict[str, Any]) -> None:
    """``attack invert`` with the given flags: parse them, run the chosen attacks as one
    batched plan (``api.attack_jobs.invert_for_cli``), print their table and notes."""
    from privfedcal.api.attack_jobs import invert_for_cli
    from privfedcal.attacks.reconstruction.scoring import records_table

    set_threads(flags["threads"])
    chosen, opts = _chosen_attacks(attacks, offered, flags)
    clients = parse_ints(flags["clients"], "--clients")
    classes = parse_ints(flags["classes"], "--classes")
    run = run_folder(flags["run_dir"], flags["run"], "attack invert", required=False)
    done = invert_for_cli(chosen, opts, run=run, out=flags["out"], clients=clients,
                          classes=classes, device=flags["device"], threads=flags["threads"],
                          seed=flags.get("seed") or 0, resume=flags["resume"],
                          overwrite=flags["overwrite"], shown=ConsoleShown(flags["quiet"]))
    print_table(records_table(done.records, f"privfedcal attack invert --{done.kind}: {done.run}"))
    print_notes(done.notes)
    console.print(f"wrote attack.json and reconstructions.png into {done.out_dir}")


def _chosen_attacks(attacks: list[Any], offered: dict[str, Any], flags: dict[str, Any]
                    ) -> tuple[list[Any], dict[str, Any]]:
    """The attacks the flags choose (their flags popped), checked together, each with its
    options."""
    from privfedcal.attacks.release_attacks import check_combination

    if flags["resume"] and flags["overwrite"]:
        raise UsageError("--resume keeps the finished targets, --overwrite discards them: "
                         "give one")
    chosen = [a for a in attacks if flags.pop(a.name)]
    check_combination(chosen, attacks)
    refuse_strays(chosen, flags, offered, attacks)
    return chosen, {a.name: given_options(a, flags) for a in chosen}


def _classes_options(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack (default: train a quick digits run).")] = None,
    seed: Annotated[int, Opt(help="Seed of the quick run.")] = 0,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-classes).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """``classes``' own options; the inference's options are ``ClassesOptions``' fields."""


def classes_command() -> Any:
    """``attack classes``: its own options, then ``ClassesOptions``' CLI fields as flags
    (``--false-positive-rate``). Written out in ``cli/command_signatures.py``
    (``attack_classes``)."""
    from privfedcal.attacks.attack_options import option_flags
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions

    def classes(**flags: Any) -> None:
        """Infer each client's class set (and counts) from its calibration uploads."""
        run_classes(flags)

    classes.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        command_options(_classes_options)
        + option_parameters(f for f in option_flags(ClassesOptions) if f.cli))
    return classes


def run_classes(flags: dict[str, Any]) -> None:
    """``attack classes`` with the given flags: infer the class sets
    (``api.attack_jobs.classes_for_cli``), print their table and notes."""
    from privfedcal.api.attack_jobs import classes_for_cli
    from privfedcal.attacks.reconstruction.scoring import classes_table
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions

    set_threads(flags["threads"])
    opts = options_given(ClassesOptions, flags, "attack classes")
    run = run_folder(flags["run_dir"], flags["run"], "attack classes", required=False)
    done = classes_for_cli(opts, run=run, out=flags["out"], seed=flags["seed"],
                           device=flags["device"], threads=flags["threads"],
                           overwrite=flags["overwrite"], shown=ConsoleShown(flags["quiet"]))
    print_table(classes_table(done.records, f"privfedcal attack classes: {done.run}"))
    print_notes(done.notes)
    console.print(f"wrote attack.json and classes.png into {done.out_dir}")


def register(app: typer.Typer) -> None:
    app.add_typer(attack_app, name="attack")
