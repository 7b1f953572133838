"""An error's code comes from its class only (privacy/error_codes.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from privfedcal.errors import (
    Diverged,
    PrivacyBudgetError,
    ReleaseSkipped,
    UploadRejected,
    UsageError,
)
from privfedcal.privacy.client_fields import FIXED_FIELDS
from privfedcal.privacy.error_codes import CODES, MEANING, ErrorCode, Refused, error_code


class _Subclassed(PrivacyBudgetError):
    """A later, more specific error keeps its base class's code."""


@pytest.mark.parametrize(("exc", "code"), [
    (Refused("x"), "refused-by-policy"),        # a UsageError: the more specific code wins
    (UsageError("x"), "bad-config"),
    (PrivacyBudgetError("x"), "budget-exhausted"),
    (_Subclassed("x"), "budget-exhausted"),
    (UploadRejected("x"), "upload-rejected-locally"),
    (ReleaseSkipped("x"), "release-skipped"),
    (Diverged(3, "x", client=1), "diverged"),
    (torch.OutOfMemoryError("x"), "out-of-memory"),
    (MemoryError("x"), "out-of-memory"),
    (RuntimeError("x"), "internal-error"),      # torch's OOM is a RuntimeError: not this one
    (ValueError("x"), "internal-error"),
    (KeyError("x"), "internal-error"),
])
def test_each_error_class_has_its_code(exc, code):
    assert error_code(exc) == code and error_code(exc).value == code


@given(st.text())
def test_the_code_does_not_depend_on_the_text(text):
    assert [error_code(cls(text)) for cls in (UsageError, UploadRejected, RuntimeError)] == \
        [ErrorCode.BAD_CONFIG, ErrorCode.UPLOAD_REJECTED, ErrorCode.INTERNAL]


def test_the_vocabulary_is_declared_with_a_meaning_each():
    assert len(set(CODES)) == len(CODES) == len(MEANING)
    (reason,) = [f for f in FIXED_FIELDS if f.name == "*/error/reason"]
    assert set(CODES) <= set(reason.values)
    assert all(f"`{c}`" in reason.holds for c in CODES)
