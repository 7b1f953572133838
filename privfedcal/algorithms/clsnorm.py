"""clsnorm (CCVR, Luo et al. NeurIPS 2021, sec. 3.3): a classifier with normalised rows,
logits ``z . W_i / ||W_i||`` and no bias, in training and at inference.

Implemented as a ``torch.nn.utils.parametrize`` row normalisation of ``classifier.weight``;
the bias is zeroed and frozen. The state-dict key of the weight becomes
``classifier.parametrizations.weight.original``: every model of a run is configured the same
way, so states move between them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from privfedcal.algorithms.algorithm import Algorithm
from privfedcal.models.feature_classifier import FeatureClassifier


class RowNormalize(nn.Module):
    """W -> W with each row divided by its L2 norm."""

    def forward(self, weight: Tensor) -> Tensor:
        return F.normalize(weight, dim=1)


class ClsNorm(Algorithm):
    """FedAvg with a weight-normalised, bias-free classifier."""

    name = "clsnorm"
    frozen_prefixes = ("classifier.bias",)

    def configure_model(self, model: FeatureClassifier, generator: torch.Generator) -> None:
        head = model.classifier
        if not parametrize.is_parametrized(head, "weight"):
            parametrize.register_parametrization(head, "weight", RowNormalize())
        if head.bias is not None:
            with torch.no_grad():
                head.bias.zero_()
            head.bias.requires_grad_(False)
