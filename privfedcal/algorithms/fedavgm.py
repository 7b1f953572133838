"""FedAvgM (Hsu et al., 2019, "Measuring the effects of non-identical data distribution"):
server momentum on the pseudo-gradient ``delta = w_global - avg_k(w_k)``::

    v <- beta * v + delta;   w_global <- w_global - server_lr * v

Local training is FedAvg's. Defaults: beta = 0.1 (CCVR paper's baseline), server_lr = 1.

Our choice: momentum applies to floating-point *parameters* only. Integer buffers
(BatchNorm's ``num_batches_tracked``) and BatchNorm running statistics (``running_mean``,
``running_var``) are taken from the average unchanged: they are statistics, not weights,
and extrapolating a variance with momentum could make it negative.
"""

from __future__ import annotations

import dataclasses

import torch

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms.algorithm import Algorithm, State, hyper

#: key prefix of the momentum buffers in the (flat) server state
MOMENTUM_PREFIX = "momentum."
_STAT_SUFFIXES = (".running_mean", ".running_var", "num_batches_tracked")


@dataclasses.dataclass(frozen=True)
class FedAvgMParams:
    """beta: server momentum in [0, 1); server_lr: server learning rate (> 0)."""

    beta: float = hyper(0.1, "server momentum")
    server_lr: float = hyper(1.0, "server learning rate")

    def __post_init__(self) -> None:
        check_number("fedavgm", "beta", self.beta, high=1.0, high_open=True)
        check_number("fedavgm", "server_lr", self.server_lr, low_open=True)


def _uses_momentum(key: str, value: torch.Tensor) -> bool:
    return value.is_floating_point() and not key.endswith(_STAT_SUFFIXES)


class FedAvgM(Algorithm):
    """FedAvg clients, momentum SGD on the server."""

    name = "fedavgm"
    dp_sgd = True
    Params = FedAvgMParams

    def server_update(
        self, global_state: State, averaged: State, server_state: State | None
    ) -> tuple[State, State | None]:
        beta, lr = self.params.beta, self.params.server_lr
        old = server_state or {}
        new_global: State = {}
        new_server: State = {}
        for key, avg in averaged.items():
            if not _uses_momentum(key, avg):
                new_global[key] = avg
                continue
            current = global_state[key].to(avg.dtype)
            delta = current - avg
            prev = old.get(MOMENTUM_PREFIX + key)
            velocity = delta if prev is None else beta * prev.to(delta) + delta
            new_server[MOMENTUM_PREFIX + key] = velocity
            new_global[key] = current - lr * velocity
        return new_global, new_server
