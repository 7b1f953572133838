"""clsprox (CCVR, Luo et al. NeurIPS 2021, sec. 3.3): a proximal term on the classifier only,
``CE + mu/2 * (||W - W_global||^2 + ||b - b_global||^2)``."""

from __future__ import annotations

import dataclasses

from torch import Tensor

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms._proximal import ProximalAnchor
from privfedcal.algorithms.base import Algorithm, State, register
from privfedcal.models.base import FeatureClassifier


@dataclasses.dataclass(frozen=True)
class ClsProxParams:
    """mu: weight of the classifier proximal term."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        check_number("clsprox", "mu", self.mu)


@register
class ClsProx(Algorithm):
    """FedAvg plus a proximal pull of the classifier (weight and bias) toward the global one."""

    name = "clsprox"
    Params = ClsProxParams

    _anchor: ProximalAnchor | None = None

    def begin_client(
        self, model: FeatureClassifier, global_state: State, client_state: State | None
    ) -> None:
        self._anchor = ProximalAnchor([p for p in model.classifier.parameters() if p.requires_grad])

    def proximal_term(self) -> Tensor:
        """``mu/2 * ||(W, b) - (W, b)_global||^2`` for the client begun last."""
        if self._anchor is None:
            raise RuntimeError("clsprox: begin_client must be called before local_loss")
        return 0.5 * self.params.mu * self._anchor.squared_distance()

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        return super().local_loss(model, x, y) + self.proximal_term()

    def end_client(self, model: FeatureClassifier) -> State | None:
        self._anchor = None
        return None
