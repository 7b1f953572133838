"""The package's errors, all under ``PrivfedcalError``; the CLI turns each of these into one
line on stderr and a non-zero exit.

Each also keeps the built-in base its callers catch (``UsageError`` is a ``ValueError``,
``Diverged`` a ``RuntimeError``), so ``except ValueError`` still sees a bad setting.
"""


class PrivfedcalError(Exception):
    """The root of every error privfedcal defines: ``except PrivfedcalError`` catches what
    the package raises on purpose and nothing else."""


class UsageError(PrivfedcalError, ValueError):
    """Bad input from the user (flags, files, data): exit code 2, no traceback."""


class PrivacyBudgetError(PrivfedcalError, RuntimeError):
    """A configuration cannot meet, or a release would exceed, the privacy budget."""


class BudgetRefused(PrivacyBudgetError):
    """A client refused a release: it would take the client past the releases its noise was
    planned for, counted by its own ledger (privacy/client_ledger.py). Its error code on the
    wire is ``code``."""

    code = "budget-exhausted"


class UploadRejected(PrivfedcalError, ValueError):
    """A client upload is malformed (shape, NaN/Inf, foreign or tampered ciphertext).
    ``reason`` is the declared code the server records (privacy/reasons.py; None: the
    recorder's default); the text, which can hold values of the upload, goes to the log."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class ReleaseSkipped(PrivfedcalError, RuntimeError):
    """A release was not made (too few valid clients for the configured guarantees, or an
    aggregate that failed its checks): the round goes on without it, nothing is released.
    Its text is the recorded code and public numbers only (privacy/reasons.py): it reaches
    the run's notes."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class Diverged(PrivfedcalError, RuntimeError):
    """Training or calibration produced non-finite numbers: the run stops at that round
    (exit code 4). ``round`` is the round reached, ``client`` the client where known.

    ``client_public`` False (model updates under secure aggregation, where the server sees
    only their sum): the client is kept for the experimenter's log (``client``) but neither
    the message nor the record, both of which reach the server's folder, names it."""

    def __init__(self, round_: int, what: str, *, client: int | None = None,
                 hint: str = "", client_public: bool = True) -> None:
        self.round, self.what, self.client, self.hint = round_, what, client, hint
        self.client_public = client_public
        #: the round of the checkpoint the run folder keeps (0: none), set by the runner
        #: that wrote it; None where unknown
        self.checkpoint_round: int | None = None
        named = client if client_public else None
        where = f"round {round_}" + (f", client {named}" if named is not None else "")
        super().__init__(f"diverged at {where}: {what}" + (f"; {hint}" if hint else ""))

    def record(self) -> dict[str, object]:
        """What ``summary.json`` holds under ``"diverged"`` (the client None where it is
        not public)."""
        return {"round": self.round, "client": self.client if self.client_public else None,
                "what": self.what, "hint": self.hint}


class Interrupted(PrivfedcalError):
    """The user stopped a command (Ctrl-C): exit code 130. The message says what was kept
    (e.g. the checkpoint a ``train --resume`` continues from). An ``Exception``, not a
    ``KeyboardInterrupt``, so that typer passes the message through."""
