"""A toy local method in one file: ``--method toy-smooth``, cross-entropy with label
smoothing (Szegedy et al., CVPR 2016, sec. 7): the target puts ``1 - eps`` on the label and
spreads ``eps`` evenly over the classes.

Its hyperparameter, its DP-SGD eligibility (a mean of per-example terms) and its loss in the
vectorised trainer's form (``--client-batch K``: per-row weights, 0 on padding rows) are all
declared here; nothing else in the package names it.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms.algorithm import Algorithm, hyper, register
from privfedcal.algorithms.vector_loss import Forward, VectorLoss, weighted_mean
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.tensors import State

NAME = "toy-smooth"


@dataclasses.dataclass(frozen=True)
class SmoothingParams:
    smoothing: float = hyper(0.1, "toy-smooth: label smoothing epsilon in [0, 1)")

    def __post_init__(self) -> None:
        if not 0 <= self.smoothing < 1:
            raise UsageError(f"toy-smooth smoothing must be in [0, 1), got {self.smoothing}")


class SmoothedLoss(VectorLoss):
    """The same loss over the real rows of a padded batch."""

    def loss(self, algo: Algorithm, forward: Forward, params: State, anchor: State,
             x: Tensor, y: Tensor, w: Tensor, ext: State) -> Tensor:
        logits = forward(params, x)[1]
        return weighted_mean(F.cross_entropy(logits, y, reduction="none",
                                             label_smoothing=algo.params.smoothing), w)


@register
class LabelSmoothing(Algorithm):
    """FedAvg with a label-smoothed local objective."""

    name = NAME
    Params = SmoothingParams
    dp_sgd = True                  # a mean of per-example terms: --dp-train may clip them
    vector_loss = SmoothedLoss()   # --client-batch K trains it vectorised

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model(x), y, label_smoothing=self.params.smoothing)
