"""Errors that the CLI turns into one line on stderr and a non-zero exit."""


class UsageError(ValueError):
    """Bad input from the user (flags, files, data): exit code 2, no traceback."""


class PrivacyBudgetError(RuntimeError):
    """A configuration cannot meet, or a release would exceed, the privacy budget."""


class BudgetRefused(PrivacyBudgetError):
    """A client refused a release: it would take the client past the releases its noise was
    planned for, counted by its own ledger (privacy/client_ledger.py). Its error code on the
    wire is ``code``."""

    code = "budget-exhausted"


class UploadRejected(ValueError):
    """A client upload is malformed (shape, NaN/Inf, foreign or tampered ciphertext)."""


class ReleaseSkipped(RuntimeError):
    """A release was not made (too few valid clients for the configured guarantees, or an
    aggregate that failed its checks): the round goes on without it, nothing is released."""


class Diverged(RuntimeError):
    """Training or calibration produced non-finite numbers: the run stops at that round
    (exit code 4). ``round`` is the round reached, ``client`` the client where known."""

    def __init__(self, round_: int, what: str, *, client: int | None = None,
                 hint: str = "") -> None:
        self.round, self.what, self.client, self.hint = round_, what, client, hint
        #: the round of the checkpoint the run folder keeps (0: none), set by the runner
        #: that wrote it; None where unknown
        self.checkpoint_round: int | None = None
        where = f"round {round_}" + (f", client {client}" if client is not None else "")
        super().__init__(f"diverged at {where}: {what}" + (f"; {hint}" if hint else ""))

    def record(self) -> dict[str, object]:
        """What ``summary.json`` holds under ``"diverged"``."""
        return {"round": self.round, "client": self.client, "what": self.what,
                "hint": self.hint}


class Interrupted(Exception):
    """The user stopped a command (Ctrl-C): exit code 130. The message says what was kept
    (e.g. the checkpoint a ``train --resume`` continues from). An ``Exception``, not a
    ``KeyboardInterrupt``, so that typer passes the message through."""
