"""Which classes a client holds, and how many samples, from its calibration upload.

Payloads are dicts of named tensors as a client uploads them, class axis first (after
``leading`` dimensions, e.g. clients). What a key shows is read from its release's
declaration (``ReleaseSpec``; ``key_tests``), never from its name: a key of sensitivity 1
counts, per class, examples (its aggregate bounded by N: ``COUNT``, read as counts) or
clients (bounded by K: ``INDICATOR``, 0/1); a key declared symmetric holds a matrix per
class (``TRACE``, as CCVR's sums of z z^T); any other holds a block of values per class
(``ROWS``: CCVR's feature sums, CReFF's class gradients), zero for a class the client lacks.

Plaintext counts answer everything. Otherwise every noised key is a test of "row c is pure
Gaussian noise of std sigma" (``noise_std``: one value for all keys, or a value for every
key of the payload; 0 = plaintext): ``COUNT`` and ``INDICATOR``: value / sigma > z_{1-a}
(one-sided); ``ROWS``: ||row||^2 / sigma^2 > chi2_{1-a}(dof); ``TRACE``: trace /
(sigma sqrt(d)) > z_{1-a} (the trace is sum_i ||z_i||^2 > 0 for a held class; the noise on
the d diagonal entries is iid whether the noise matrix is symmetrised or not). A class is
declared present when any test rejects at level a / (number of tests) (Bonferroni), so the
false-positive rate per class is at most ``false_positive_rate``. Noise-free keys without
counts: present iff the row is non-zero. Counts are returned only when a ``COUNT`` key was
uploaded (rounded, >= 1 for present classes); ``count_lower_bound`` bounds hidden counts
from feature sums and the traces of their squares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from scipy.stats import chi2, norm
from torch import Tensor

from privfedcal.errors import UsageError

Payload = Mapping[str, Tensor]
#: what a payload key shows about the classes a client holds (``key_tests``)
COUNT, INDICATOR, TRACE, ROWS = "count", "indicator", "trace", "rows"


def key_tests(spec: Any) -> dict[str, str]:
    """Payload key -> its presence test, read from a release's declaration
    (``ReleaseSpec``): sensitivity 1 with an aggregate bounded by N examples is a count, by
    anything else (K clients) an indicator; a symmetric key holds a matrix per class; any
    other key a block of values per class."""
    out = {}
    for key, sens in spec.sensitivity.items():
        if sens.strip() == "1":
            out[key] = COUNT if spec.magnitude[key].strip() == "N" else INDICATOR
        else:
            out[key] = TRACE if key in spec.symmetric else ROWS
    return out


def _sigma(noise_std: float | Mapping[str, float], key: str) -> float:
    if isinstance(noise_std, Mapping):
        if key not in noise_std:
            raise UsageError(f"noise_std gives no value for payload key {key!r}")
        s = noise_std[key]
    else:
        s = noise_std
    if s < 0 or not math.isfinite(s):
        raise UsageError(f"noise_std for {key!r} must be finite and >= 0, got {s}")
    return float(s)


def _statistic(test: str, value: Tensor, leading: int) -> tuple[Tensor, str, int]:
    """Per-class statistic (..., C), its null distribution ('normal' / 'chi2') and dof."""
    v = value.double()
    if test in (COUNT, INDICATOR):
        return v, "normal", 1
    if test == TRACE:
        return torch.diagonal(v, dim1=-2, dim2=-1).sum(-1), "normal", v.shape[-1]
    rows = v.flatten(leading + 1)  # the block of each class as one row
    return rows.pow(2).sum(-1), "chi2", rows.shape[-1]


def infer_classes(
    payload: Payload,
    *,
    tests: Mapping[str, str],
    noise_std: float | Mapping[str, float] = 0.0,
    false_positive_rate: float = 1e-3,
    leading: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """``(present bool[..., C], counts float[..., C] | None)`` for one client's payload
    (``leading`` dimensions before the class axis); ``tests``: each key's presence test
    (``key_tests`` of the release's declaration)."""
    if not 0 < false_positive_rate < 1:
        raise UsageError(f"false_positive_rate must be in (0, 1), got {false_positive_rate}")
    keys = [k for k in payload if k in tests]
    if not keys:
        raise UsageError(f"payload has none of the declared keys {', '.join(tests) or '(none)'}")
    counts = None
    counted = [k for k in keys if tests[k] == COUNT]
    if counted:
        c = payload[counted[0]].double()
        if _sigma(noise_std, counted[0]) == 0:
            return c > 0.5, c.float()
        counts = c.round().clamp_min(0)
    exact = [k for k in keys if _sigma(noise_std, k) == 0]
    if exact:  # a noise-free row is zero exactly when the class is absent
        present = None
        for k in exact:
            stat, _, _ = _statistic(tests[k], payload[k], leading)
            hit = stat.abs() > (0.5 if tests[k] == INDICATOR else 0.0)
            present = hit if present is None else present | hit
    else:
        alpha = false_positive_rate / len(keys)
        present = None
        for k in keys:
            stat, law, dof = _statistic(tests[k], payload[k], leading)
            sigma = _sigma(noise_std, k)
            if law == "normal":
                hit = stat / (sigma * math.sqrt(dof)) > norm.ppf(1 - alpha)
            else:
                hit = stat / sigma**2 > chi2.ppf(1 - alpha, dof)
            present = hit if present is None else present | hit
    assert present is not None
    if counts is not None:
        counts = torch.where(present, counts.clamp_min(1), torch.zeros_like(counts)).float()
    return present, counts


def count_lower_bound(sums: Tensor, squares: Tensor) -> Tensor:
    """Hidden counts bounded below from plaintext per-class feature sums ``sums`` (..., C,
    d) and sums of z z^T ``squares`` (..., C, d, d) (Cauchy-Schwarz):
    ``||sum_i z_i||^2 <= n sum_i ||z_i||^2``, so ``n >= ||s||^2 / tr(S)``. Tight when a
    class's features are nearly equal (as after ReLU with small within-class spread)."""
    s = sums.double().pow(2).sum(-1)
    tr = torch.diagonal(squares.double(), dim1=-2, dim2=-1).sum(-1)
    bound = torch.where(tr > 0, s / tr.clamp_min(1e-300), torch.zeros_like(s))
    return torch.ceil(bound - 1e-9).clamp_min(0).float()


def score_class_sets(pred: tuple[Tensor, Tensor | None], truth: Tensor) -> dict[str, float]:
    """Compare inferred ``(present, counts)`` with true per-class counts (same shape).

    Returns presence accuracy, precision, recall (1.0 when nothing was predicted / held)
    and the mean absolute count error over all entries (NaN when no counts were inferred).
    """
    present, counts = pred
    truth = truth.double()
    if present.shape != truth.shape:
        raise UsageError(f"prediction {tuple(present.shape)} and truth {tuple(truth.shape)} differ")
    held = truth > 0
    tp = float((present & held).sum())
    n_pred, n_held = float(present.sum()), float(held.sum())
    return {
        "accuracy": float((present == held).double().mean()),
        "precision": tp / n_pred if n_pred else 1.0,
        "recall": tp / n_held if n_held else 1.0,
        "count_mae": float((counts.double() - truth).abs().mean())
        if counts is not None
        else float("nan"),
    }
