"""What a client's upload is, and the bound its rows are clipped to before they are summed.

A payload is a dict of named tensors (sums over one client's samples). Payload tasks
(federation/hooks.py ``PayloadTask``) pass every per-sample quantity they sum through
``Bound.clip``, so that the sensitivities the DP noise is calibrated to hold
(privacy/stages.py ``BoundStage``).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

Payload = dict[str, Tensor]


class Bound(Protocol):
    """The client-side bounding stage: clips per-sample rows before they are summed.

    ``rows`` is (n, ...) with one entry per local sample; each entry's flattened L2 norm is
    clipped to the configured bound (identity when bounding is off). Tasks must pass every
    per-sample quantity they sum through ``clip`` so that sensitivities hold.
    """

    def clip(self, rows: Tensor, kind: str) -> Tensor: ...


class NoBound:
    """Bounding off: the identity."""

    def clip(self, rows: Tensor, kind: str) -> Tensor:
        return rows
