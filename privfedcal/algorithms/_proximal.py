"""The proximal penalty ``mu/2 * sum ||w - w_anchor||^2`` shared by FedProx and clsprox, on
live parameters (``ProximalAnchor``) and in the vectorised trainer's form (``ProximalLoss``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from privfedcal.algorithms.vector_loss import Forward, VectorLoss, weighted_ce
from privfedcal.tensors import State


class ProximalAnchor:
    """Detached clones of some parameters, and the squared distance of the live ones to them."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.anchor = [p.detach().clone() for p in params]

    def squared_distance(self) -> Tensor:
        """``sum_i ||p_i - anchor_i||^2`` (differentiable in the live parameters)."""
        if not self.params:
            return torch.zeros(())
        return torch.stack(
            [(p - a).pow(2).sum() for p, a in zip(self.params, self.anchor, strict=True)]
        ).sum()


class ProximalLoss(VectorLoss):
    """FedProx / clsprox: ``CE + mu/2 * sum ||w - w_global||^2`` over the anchored
    parameters (``prefix``: all trainable ones, or the classifier's)."""

    def __init__(self, prefix: str = "model.") -> None:
        self.prefix = prefix

    def loss(self, algo: Any, forward: Forward, params: State, anchor: State, x: Tensor,
             y: Tensor, w: Tensor, ext: State) -> Tensor:
        ce = weighted_ce(forward(params, x)[1], y, w)
        terms = [(p - anchor[k]).pow(2).sum() for k, p in params.items()
                 if k.startswith(self.prefix)]
        if not terms:
            return ce
        return ce + 0.5 * algo.params.mu * torch.stack(terms).sum()
