"""Attacks on what an honest-but-curious server sees, in two packages: ``reconstruction``
(feature and gradient inversion, class-set inference, disaggregation, and the metrics that
score them) and ``distinguishing`` (the DP audit's games: lower bounds on epsilon). Shared
by both: the attack registry (``release_attacks``) and the server's view of a run
(``view``). Below, the reconstruction functions the package re-exports.

Names load on first use (PEP 562): importing a submodule (the CLI reads one constant of
``feature_inversion``) does not pull in torchmetrics, scipy and torchvision, which only the
metrics and class inference need.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FeatureTarget": "privfedcal.attacks.reconstruction.feature_targets",
    "GradientInversionResult": "privfedcal.attacks.reconstruction.gradient_inversion",
    "InversionConfig": "privfedcal.attacks.reconstruction.feature_inversion",
    "InversionResult": "privfedcal.attacks.reconstruction.feature_inversion",
    "LabelInfo": "privfedcal.attacks.reconstruction.gradient_inversion",
    "best_match": "privfedcal.attacks.reconstruction.metrics",
    "count_lower_bound": "privfedcal.attacks.reconstruction.class_inference",
    "feature_cosine": "privfedcal.attacks.reconstruction.metrics",
    "features_from_stats": "privfedcal.attacks.reconstruction.feature_targets",
    "infer_classes": "privfedcal.attacks.reconstruction.class_inference",
    "invert_class_gradient": "privfedcal.attacks.reconstruction.gradient_inversion",
    "invert_features": "privfedcal.attacks.reconstruction.feature_inversion",
    "invert_features_many": "privfedcal.attacks.reconstruction.feature_inversion",
    "invert_update": "privfedcal.attacks.reconstruction.model_updates",
    "labels_from_bias_gradient": "privfedcal.attacks.reconstruction.gradient_inversion",
    "matched_psnr": "privfedcal.attacks.reconstruction.metrics",
    "nearest_is_true": "privfedcal.attacks.reconstruction.metrics",
    "psnr": "privfedcal.attacks.reconstruction.metrics",
    "recover_from_class_gradient": "privfedcal.attacks.reconstruction.gradient_inversion",
    "score_class_sets": "privfedcal.attacks.reconstruction.class_inference",
    "split_class_gradient": "privfedcal.attacks.reconstruction.gradient_inversion",
    "ssim": "privfedcal.attacks.reconstruction.metrics",
    "LocalRecipe": "privfedcal.attacks.reconstruction.model_updates",
    "invert_model_update": "privfedcal.attacks.reconstruction.model_updates",
    "labels_from_update": "privfedcal.attacks.reconstruction.model_updates",
    "recover_rank_n": "privfedcal.attacks.reconstruction.gradient_inversion",
    "simulate_local_training": "privfedcal.attacks.reconstruction.model_updates",
    "eval_mode": "privfedcal.attacks.reconstruction.modes",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'privfedcal.attacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "FeatureTarget",
    "GradientInversionResult",
    "InversionConfig",
    "InversionResult",
    "LabelInfo",
    "best_match",
    "count_lower_bound",
    "feature_cosine",
    "features_from_stats",
    "infer_classes",
    "invert_class_gradient",
    "invert_features",
    "invert_features_many",
    "invert_update",
    "labels_from_bias_gradient",
    "matched_psnr",
    "nearest_is_true",
    "psnr",
    "recover_from_class_gradient",
    "score_class_sets",
    "split_class_gradient",
    "ssim",
    "LocalRecipe",
    "invert_model_update",
    "labels_from_update",
    "recover_rank_n",
    "simulate_local_training",
    "eval_mode",
]
