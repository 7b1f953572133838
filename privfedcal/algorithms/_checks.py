"""Validation helpers for method hyperparameters (raise UsageError with one clear line)."""

from __future__ import annotations

import math

from privfedcal.errors import UsageError


def check_number(
    method: str,
    name: str,
    value: object,
    *,
    low: float = 0.0,
    low_open: bool = False,
    high: float | None = None,
    high_open: bool = False,
) -> None:
    """Require a finite real ``value`` in the interval [low, high] (ends open if asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{method}: {name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        upper = "inf)" if high is None else f"{high:g}{hi}"
        raise UsageError(f"{method}: {name} must be in {lo}{low:g}, {upper}, got {value!r}")
