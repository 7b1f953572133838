"""Which classes a client holds, and how many samples, from its calibration upload.

Payloads are dicts of named tensors as a client uploads them (leading dims, e.g. clients,
are allowed): CCVR ``count`` (C,), ``sum`` (C, d), ``outer`` (C, d, d); CReFF ``grad``
(C, C, d+1) (row block c: the client's class-c classifier gradient, bias last; zeros when
it holds no c) with ``count`` or ``holders`` (C,) presence indicators.

Plaintext counts answer everything. Otherwise every noised key is a test of "row c is pure
Gaussian noise of std sigma" (``noise_std``: one value for all keys, or a value for every
key of the payload; 0 = plaintext):
``count`` and ``holders``: value / sigma > z_{1-a} (one-sided); ``sum`` and ``grad``:
||row||^2 / sigma^2 > chi2_{1-a}(dof); ``outer``: trace / (sigma sqrt(d)) > z_{1-a}
(the trace is sum_i ||z_i||^2 > 0 for a held class; the noise on the d diagonal entries is
iid whether the noise matrix is symmetrised or not). A class is declared present when any
test rejects at level a / (number of tests) (Bonferroni), so the false-positive rate per
class is at most ``false_positive_rate``. Noise-free keys without counts: present iff the
row is non-zero. Counts are returned only when ``count`` was uploaded (rounded, >= 1 for
present classes); ``count_lower_bound`` bounds hidden counts from ``sum`` and ``outer``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from scipy.stats import chi2, norm
from torch import Tensor

from privfedcal.errors import UsageError

Payload = Mapping[str, Tensor]
KEYS = ("count", "holders", "sum", "outer", "grad")


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


def _statistic(key: str, value: Tensor) -> tuple[Tensor, str, int]:
    """Per-class statistic (..., C), its null distribution ('normal' / 'chi2') and dof."""
    v = value.double()
    if key in ("count", "holders"):
        return v, "normal", 1
    if key == "outer":
        return torch.diagonal(v, dim1=-2, dim2=-1).sum(-1), "normal", v.shape[-1]
    rows = v.flatten(-2) if key == "grad" else v
    return rows.pow(2).sum(-1), "chi2", rows.shape[-1]


def infer_classes(
    payload: Payload,
    *,
    noise_std: float | Mapping[str, float] = 0.0,
    false_positive_rate: float = 1e-3,
) -> tuple[Tensor, Tensor | None]:
    """``(present bool[..., C], counts float[..., C] | None)`` for one client's payload."""
    if not 0 < false_positive_rate < 1:
        raise UsageError(f"false_positive_rate must be in (0, 1), got {false_positive_rate}")
    keys = [k for k in KEYS if k in payload]
    if not keys:
        raise UsageError(f"payload has none of the keys {', '.join(KEYS)}")
    counts = None
    if "count" in keys:
        c = payload["count"].double()
        if _sigma(noise_std, "count") == 0:
            return c > 0.5, c.float()
        counts = c.round().clamp_min(0)
    exact = [k for k in keys if _sigma(noise_std, k) == 0]
    if exact:  # a noise-free row is zero exactly when the class is absent
        present = None
        for k in exact:
            stat, _, _ = _statistic(k, payload[k])
            hit = stat.abs() > (0.5 if k == "holders" else 0.0)
            present = hit if present is None else present | hit
    else:
        alpha = false_positive_rate / len(keys)
        present = None
        for k in keys:
            stat, law, dof = _statistic(k, payload[k])
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


def count_lower_bound(payload: Payload) -> Tensor:
    """Hidden counts bounded below from plaintext ``sum`` and ``outer`` (Cauchy-Schwarz):
    ``||sum_i z_i||^2 <= n sum_i ||z_i||^2``, so ``n >= ||s||^2 / tr(S)``. Tight when a
    class's features are nearly equal (as after ReLU with small within-class spread)."""
    if "sum" not in payload or "outer" not in payload:
        raise UsageError("count_lower_bound needs the 'sum' and 'outer' entries")
    s = payload["sum"].double().pow(2).sum(-1)
    tr = torch.diagonal(payload["outer"].double(), dim1=-2, dim2=-1).sum(-1)
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
