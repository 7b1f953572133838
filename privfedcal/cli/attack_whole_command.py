"""``privfedcal attack <name>`` for every registered attack on the run as a whole
(``ReleaseAttack.run``; ``disaggregate`` differences the secure sums of a run into
per-client values): its options type's fields are its flags; it writes ``attack.json`` (and
the attack's figure) into RUN/attack-<name>/ all or nothing and prints its table
(``ReleaseAttack.console``) or a count of its records. ``cli/attack_command.py`` builds the
commands from the registry when click asks for them; the job is
``api.attack_jobs.whole_for_cli``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from privfedcal.cli.args import run_folder
from privfedcal.cli.attack_flags import given_options, option_parameters
from privfedcal.cli.console import console, print_table
from privfedcal.cli.train_command import command_options
from privfedcal.errors import UsageError

Opt = typer.Option


def set_threads(threads: int | None) -> None:
    """``--threads N``: torch intra-op threads for this process (None: torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def print_notes(notes: list[str]) -> None:
    for note in dict.fromkeys(notes):  # once each, in order
        console.print(f"[yellow]note:[/yellow] {note}")


def _run_attack_options(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack.")] = None,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-<name>).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
) -> None:
    """The options of every command of an attack on the run as a whole."""


def run_attack_command(attack: Any) -> Any:
    """``attack <name>`` for a registered attack on the run as a whole (``disaggregate``):
    its options type's CLI fields are its flags; it writes attack.json (and its figure)
    into RUN/attack-<name>/ and prints its table, or a count of its records. Written out
    for ``disaggregate`` in ``cli/command_signatures.py``."""
    from privfedcal.attacks.attack_options import option_flags

    def command(**flags: Any) -> None:
        run_whole(attack, flags)

    command.__doc__ = attack.summary
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        command_options(_run_attack_options)
        + option_parameters(f for f in option_flags(attack.options) if f.cli))
    return command


def run_whole(attack: Any, flags: dict[str, Any]) -> None:
    """``attack <name>`` with the given flags: run it (``api.attack_jobs.whole_for_cli``),
    print its table (or a count of its records) and notes."""
    from privfedcal.api.attack_jobs import whole_for_cli

    set_threads(flags["threads"])
    opts = given_options(attack, flags)
    name = attack.name
    run = run_folder(flags["run_dir"], flags["run"], f"attack {name}", required=True)
    done = whole_for_cli(attack, opts, run=run, out=flags["out"], device=flags["device"],
                         overwrite=flags["overwrite"])
    if attack.console is not None:
        table, lines = attack.console(done.records, f"privfedcal attack {name}: {run}")
        print_table(table)
        for line in lines:
            console.print(line)
    else:
        console.print(f"{len(done.records)} records")
    print_notes(done.notes)
    console.print(f"wrote {' and '.join(done.files)} into {done.out_dir}")
