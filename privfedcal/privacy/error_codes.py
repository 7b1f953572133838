"""The codes a client sends in place of an error's text: a fixed, declared vocabulary.

An error message is a release too: its text can hold anything the failing code had at hand
(a shape, a path, a loss, the magnitude of a decrypted sum). So a client never sends it. A
Flower ClientApp that fails answers with an error reply whose reason is one of these codes
(``flower/client_app.py``), and logs the full error on its own node; the key holder's
refusal to decrypt a sum (``query.decrypt``'s ``rejected`` record) is a code as well. The
codes are declared public in ``privacy/client_fields.py`` (``*/error/reason``), and the wire
walk (``tests/flower/test_wire_fields.py``) fails on any reason outside them.

Each code is derived from the exception class alone, never from its text
(``error_code``). Which code, and that an error happened at all, can still depend on the
client's data (a client that runs out of memory or diverges): that is a few bits per
failure, no more than the dropped reply the server sees anyway, and not charged to the
budget (docs/threat-model.md).
"""

from __future__ import annotations

from enum import StrEnum

import torch

from privfedcal.errors import (
    Diverged,
    PrivacyBudgetError,
    ReleaseSkipped,
    UploadRejected,
    UsageError,
)


class ErrorCode(StrEnum):
    """Why a client could not answer a message: the whole of what it says about an error."""

    BAD_CONFIG = "bad-config"
    REFUSED = "refused-by-policy"
    UNKNOWN_MESSAGE = "unknown-message"
    BUDGET_EXHAUSTED = "budget-exhausted"
    UPLOAD_REJECTED = "upload-rejected-locally"
    RELEASE_SKIPPED = "release-skipped"
    DIVERGED = "diverged"
    OUT_OF_MEMORY = "out-of-memory"
    INTERNAL = "internal-error"


#: what each code means, for the declared row and the docs
MEANING: dict[ErrorCode, str] = {
    ErrorCode.BAD_CONFIG: "the node's or the run's config is wrong, or the message does not "
                          "fit them (UsageError)",
    ErrorCode.REFUSED: "the node's privacy settings refuse the request (local evaluation "
                       "under DP)",
    ErrorCode.UNKNOWN_MESSAGE: "no handler for the message type",
    ErrorCode.BUDGET_EXHAUSTED: "the release would exceed the privacy budget "
                                "(PrivacyBudgetError)",
    ErrorCode.UPLOAD_REJECTED: "the node's own check refused an upload or a sum "
                               "(UploadRejected)",
    ErrorCode.RELEASE_SKIPPED: "the release was not made (ReleaseSkipped)",
    ErrorCode.DIVERGED: "non-finite numbers in training or calibration (Diverged)",
    ErrorCode.OUT_OF_MEMORY: "the node ran out of host or device memory",
    ErrorCode.INTERNAL: "any other error",
}


class Refused(UsageError):
    """A request that the node's privacy settings refuse (sent as ``refused-by-policy``)."""


#: exception classes and their codes, most specific first (Refused is a UsageError)
_BY_CLASS: tuple[tuple[tuple[type[BaseException], ...], ErrorCode], ...] = (
    ((Refused,), ErrorCode.REFUSED),
    ((UsageError,), ErrorCode.BAD_CONFIG),
    ((PrivacyBudgetError,), ErrorCode.BUDGET_EXHAUSTED),
    ((UploadRejected,), ErrorCode.UPLOAD_REJECTED),
    ((ReleaseSkipped,), ErrorCode.RELEASE_SKIPPED),
    ((Diverged,), ErrorCode.DIVERGED),
    ((MemoryError, torch.OutOfMemoryError), ErrorCode.OUT_OF_MEMORY),
)


def error_code(exc: BaseException) -> ErrorCode:
    """The code of ``exc``, from its class only, never its text."""
    for classes, code in _BY_CLASS:
        if isinstance(exc, classes):
            return code
    return ErrorCode.INTERNAL


#: every code, as sent
CODES: tuple[str, ...] = tuple(c.value for c in ErrorCode)

__all__ = ["CODES", "MEANING", "ErrorCode", "Refused", "error_code"]
