"""FedProx (Li et al., MLSys 2020, Eq. 2): local loss ``CE + mu/2 * ||w - w_global||^2``
over every trainable parameter (frozen ones are constant and add nothing)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms._proximal import ProximalAnchor, ProximalLoss
from privfedcal.algorithms.algorithm import Algorithm, ClientContext, State, hyper
from privfedcal.models.feature_classifier import FeatureClassifier


@dataclasses.dataclass(frozen=True)
class FedProxParams:
    """mu: weight of the proximal term (CCVR's baseline setting: 0.01)."""

    mu: float = hyper(0.01, "weight of the proximal term mu/2 ||w - w_global||^2")

    def __post_init__(self) -> None:
        check_number("fedprox", "mu", self.mu)


class FedProx(Algorithm):
    """FedAvg plus a proximal pull toward the global model the client received."""

    name = "fedprox"
    Params: ClassVar[type] = FedProxParams
    vector_loss = ProximalLoss()

    _anchor: ProximalAnchor | None = None

    def begin_client(
        self, model: FeatureClassifier, global_state: State, client_state: State | None,
        ctx: ClientContext | None = None,
    ) -> None:
        # The model holds the received global state: its trainable parameters are w_global.
        self._anchor = ProximalAnchor(self.anchored_parameters(model))

    def anchored_parameters(self, model: FeatureClassifier) -> list:
        """The parameters pulled toward the global model (all trainable ones)."""
        return [p for p in model.parameters() if p.requires_grad]

    def proximal_term(self) -> Tensor:
        """``mu/2 * sum ||w - w_global||^2`` for the client begun last."""
        if self._anchor is None:
            raise RuntimeError(f"{self.name}: begin_client must be called before local_loss")
        return 0.5 * self.params.mu * self._anchor.squared_distance()

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        return super().local_loss(model, x, y) + self.proximal_term()

    def end_client(self, model: FeatureClassifier) -> State | None:
        self._anchor = None
        return None
