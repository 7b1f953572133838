"""A method's local loss in the form the vectorised trainer (``--client-batch K``,
federation/vectorised.py) runs per client under ``torch.func.vmap``: a functional forward,
per-row weights (1 for a real row, 0 for padding) and weighted means.

A method declares its own as ``vector_loss`` on its class (``Algorithm.vector_loss``), built-in
methods and extensions alike; with every weight 1 it must equal the method's ``local_loss``
(tests/federation/test_vector_losses.py checks every registered method's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from privfedcal.tensors import State

#: (params, x) -> (features z, logits) for one client, trainable entries from ``params``
Forward = Callable[[State, Tensor], tuple[Tensor, Tensor]]


def weighted_mean(values: Tensor, w: Tensor) -> Tensor:
    """Mean of ``values`` over the rows with weight 1 (``w`` is 0/1; at least one 1)."""
    return (values * w).sum() / w.sum()


def weighted_ce(logits: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """``F.cross_entropy(logits, y)`` over the real rows only."""
    return weighted_mean(F.cross_entropy(logits, y, reduction="none"), w)


class VectorLoss:
    """FedAvg's loss, the default: cross-entropy of the classifier's logits. A method with
    another loss subclasses it and overrides ``loss`` (and ``prepare``/``client_state``
    when the loss reads per-client state, as MOON's previous model)."""

    def prepare(self, trainer: Any, global_state: State, client_states: list[State | None]
                ) -> State:
        """Per-client tensors (dim 0 = clients, in the trainer's client order) the loss
        reads as ``ext``; ``client_states`` are the method's kept states."""
        return {}

    def loss(self, algo: Any, forward: Forward, params: State, anchor: State, x: Tensor,
             y: Tensor, w: Tensor, ext: State) -> Tensor:
        """One client's loss; ``anchor`` holds the received global trainable parameters."""
        return weighted_ce(forward(params, x)[1], y, w)

    def client_state(self, state: State) -> State | None:
        """What the method keeps for the client after training to ``state`` (or None)."""
        return None
