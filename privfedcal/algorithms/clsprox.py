"""clsprox (CCVR, Luo et al. NeurIPS 2021, sec. 3.3): a proximal term on the classifier only,
``CE + mu/2 * (||W - W_global||^2 + ||b - b_global||^2)``. FedProx with the anchor restricted
to the classifier."""

from __future__ import annotations

import dataclasses

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms._proximal import ProximalLoss
from privfedcal.algorithms.algorithm import hyper
from privfedcal.algorithms.fedprox import FedProx
from privfedcal.models.feature_classifier import FeatureClassifier


@dataclasses.dataclass(frozen=True)
class ClsProxParams:
    """mu: weight of the classifier proximal term."""

    mu: float = hyper(0.01, "weight of the classifier's proximal term")

    def __post_init__(self) -> None:
        check_number("clsprox", "mu", self.mu)


class ClsProx(FedProx):
    """FedAvg plus a proximal pull of the classifier (weight and bias) toward the global one."""

    name = "clsprox"
    Params = ClsProxParams
    vector_loss = ProximalLoss("model.classifier.")

    def anchored_parameters(self, model: FeatureClassifier) -> list:
        return [p for p in model.classifier.parameters() if p.requires_grad]
