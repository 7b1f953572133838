"""The proximal penalty ``mu/2 * sum ||w - w_anchor||^2`` shared by FedProx and clsprox."""

from __future__ import annotations

import torch
from torch import Tensor, nn


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
