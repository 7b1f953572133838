"""The ``privfedcal`` command: one typer app, one module per sub-command.

Every error a user can cause ends as one line on stderr and a non-zero exit, never a
traceback: 2 for usage errors, 3 for privacy-budget errors, 4 for a run stopped by the
divergence guard (non-finite loss, model or calibration), 130 when interrupted.
"""

from __future__ import annotations

import sys

import click
import typer

from privfedcal.cli import (
    analyze_command,
    attack_command,
    audit_command,
    compare_command,
    partition_command,
    report_command,
    train_command,
)
from privfedcal.errors import Diverged, Interrupted, PrivacyBudgetError, UsageError

app = typer.Typer(
    name="privfedcal",
    help="Federated learning with classifier calibration, hardened uploads and privacy audits.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


# One module per command; each keeps its heavy imports inside the command so that
# `privfedcal --help` stays fast.
for command in (train_command, partition_command, analyze_command, attack_command, audit_command,
                report_command, compare_command):
    command.register(app)


#: the exit status of a command stopped by Ctrl-C (SIGINT), as shells report it
INTERRUPTED = 130


def fail(message: str, code: int = 2) -> None:
    """Print one line on stderr and exit."""
    print(f"privfedcal: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def diverged_kept(exc: Diverged) -> str:
    """What a diverged run left in its folder, as it is."""
    kept = "summary.json marks the run diverged"
    if exc.checkpoint_round is None:
        return kept
    if exc.checkpoint_round == 0:
        return f"{kept}; no round had finished, so no checkpoint was kept"
    return (f"{kept}; the checkpoint of round {exc.checkpoint_round} (the last finite one) "
            "and its metrics are kept")


def main(argv: list[str] | None = None) -> None:
    try:
        # Outside standalone mode typer does not exit: it turns a KeyboardInterrupt into
        # exit code 130 and *returns* that code (as it does for ``typer.Exit(code)``), so
        # the returned value is this process's exit status. Commands return None.
        code = app(args=argv, prog_name="privfedcal", standalone_mode=False)
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except click.exceptions.Abort:
        fail("aborted", 130)
    except click.exceptions.UsageError as exc:
        fail(exc.format_message().replace("\n", " "), 2)
    except click.ClickException as exc:
        fail(exc.format_message().replace("\n", " "), exc.exit_code or 1)
    except UsageError as exc:
        fail(str(exc), 2)
    except PrivacyBudgetError as exc:
        fail(f"privacy budget: {exc}", 3)
    except Diverged as exc:
        fail(f"training {exc} ({diverged_kept(exc)})", 4)
    except OSError as exc:  # disk full, a folder made read-only mid-run: still one line
        where = f": {exc.filename}" if exc.filename else ""
        fail(f"{exc.strerror or exc}{where}", 1)
    except Interrupted as exc:
        fail(f"interrupted: {exc}" if str(exc) else "interrupted", INTERRUPTED)
    except KeyboardInterrupt:  # outside a command: while parsing or importing
        code = INTERRUPTED
    if code == INTERRUPTED:
        fail("interrupted", INTERRUPTED)
    if isinstance(code, int) and code:
        raise SystemExit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
