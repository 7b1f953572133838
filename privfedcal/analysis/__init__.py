"""Analyses the papers use: classifier row norms and singular values (CCVR fig. 3, FedUV
fig. 1), linear CKA between client models (CCVR figs. 1-2) and GMM separability as mean
sliced Wasserstein distance between class Gaussians (CCVR fig. 6).

Pure functions on tensors; the PNG plots live in :mod:`privfedcal.analysis.analysis_plots` (imported
on demand, so that the math does not pull in matplotlib).
"""

from privfedcal.analysis.cka import CKAResult, cka_matrix, layer_features, linear_cka, pairwise_cka
from privfedcal.analysis.classifier import classifier_norms, classifier_weight, singular_values
from privfedcal.analysis.separability import (
    mean_sliced_wasserstein,
    pairwise_sliced_wasserstein,
    random_directions,
    sliced_wasserstein_gaussians,
)

__all__ = [
    "CKAResult",
    "cka_matrix",
    "classifier_norms",
    "classifier_weight",
    "layer_features",
    "linear_cka",
    "mean_sliced_wasserstein",
    "pairwise_cka",
    "pairwise_sliced_wasserstein",
    "random_directions",
    "singular_values",
    "sliced_wasserstein_gaussians",
]
