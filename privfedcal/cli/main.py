"""The ``privfedcal`` command: one typer app, one module per sub-command.

Every error a user can cause ends as one line on stderr and a non-zero exit, never a
traceback: 2 for usage errors, 3 for privacy-budget errors, 4 for a run stopped by the
divergence guard (non-finite loss, model or calibration), 130 when interrupted.
"""

from __future__ import annotations

import sys

import click
import typer

from privfedcal.cli import analyze, attack, audit, compare, partition, report, train
from privfedcal.errors import Diverged, PrivacyBudgetError, UsageError

app = typer.Typer(
    name="privfedcal",
    help="Federated learning with classifier calibration, hardened uploads and privacy audits.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


# One module per command; each keeps its heavy imports inside the command so that
# `privfedcal --help` stays fast.
for command in (train, partition, analyze, attack, audit, report, compare):
    command.register(app)


def fail(message: str, code: int = 2) -> None:
    """Print one line on stderr and exit."""
    print(f"privfedcal: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="privfedcal", standalone_mode=False)
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
        fail(f"training {exc} (summary.json marks the run diverged; metrics and the last "
             "finite checkpoint are kept)", 4)
    except KeyboardInterrupt:
        fail("interrupted", 130)


if __name__ == "__main__":  # pragma: no cover
    main()
