"""Freeze (FedBABU, Oh et al., ICLR 2022; the "Freeze" baseline of FedUV, CVPR 2024): the
classifier is a random matrix with orthonormal rows, zero bias, never trained or averaged.

The rows are orthonormal when C <= d (the usual case); with more classes than feature
dimensions ``orthogonal_`` makes the columns orthonormal instead. ``generator`` must be a CPU
generator (the matrix is drawn on the CPU, then copied to the model's device).

Every model of a run (server and workers) is configured with an identically seeded
generator, so the frozen head is the same everywhere; it is also listed in
``frozen_prefixes`` so aggregation keeps the global copy.
"""

from __future__ import annotations

import torch
from torch import nn

from privfedcal.algorithms.algorithm import Algorithm
from privfedcal.models.feature_classifier import FeatureClassifier


class Freeze(Algorithm):
    """FedAvg on the feature extractor under a fixed orthogonal classifier."""

    name = "freeze"
    dp_sgd = True
    frozen_prefixes = ("classifier.",)

    def configure_model(self, model: FeatureClassifier, generator: torch.Generator) -> None:
        head = model.classifier
        with torch.no_grad():
            # orthogonal_ draws on the CPU; copy so the generator's device never matters
            weight = torch.empty(head.weight.shape, dtype=head.weight.dtype)
            nn.init.orthogonal_(weight, generator=generator)
            head.weight.copy_(weight)
            if head.bias is not None:
                head.bias.zero_()
        head.requires_grad_(False)
