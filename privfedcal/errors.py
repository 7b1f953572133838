"""Errors that the CLI turns into one line on stderr and a non-zero exit."""


class UsageError(ValueError):
    """Bad input from the user (flags, files, data): exit code 2, no traceback."""


class PrivacyBudgetError(RuntimeError):
    """A configuration cannot meet, or a release would exceed, the privacy budget."""


class UploadRejected(ValueError):
    """A client upload is malformed (shape, NaN/Inf, foreign or tampered ciphertext)."""


class ReleaseSkipped(RuntimeError):
    """A release was not made (too few valid clients for the configured guarantees, or an
    aggregate that failed its checks): the round goes on without it, nothing is released."""
