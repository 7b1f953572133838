"""Attacks on what an honest-but-curious server sees: feature and gradient inversion,
class-set inference, and the metrics that score them (pure functions; the CLI wraps them).

Names load on first use (PEP 562): importing a submodule (the CLI reads one constant of
``feature_inversion``) does not pull in torchmetrics, scipy and torchvision, which only the
metrics and class inference need.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FeatureTarget": "privfedcal.attacks.feature_targets",
    "GradientInversionResult": "privfedcal.attacks.gradient_inversion",
    "InversionConfig": "privfedcal.attacks.feature_inversion",
    "InversionResult": "privfedcal.attacks.feature_inversion",
    "LabelInfo": "privfedcal.attacks.gradient_inversion",
    "best_match": "privfedcal.attacks.metrics",
    "count_lower_bound": "privfedcal.attacks.class_inference",
    "feature_cosine": "privfedcal.attacks.metrics",
    "features_from_stats": "privfedcal.attacks.feature_targets",
    "infer_classes": "privfedcal.attacks.class_inference",
    "invert_class_gradient": "privfedcal.attacks.gradient_inversion",
    "invert_features": "privfedcal.attacks.feature_inversion",
    "invert_features_many": "privfedcal.attacks.feature_inversion",
    "invert_update": "privfedcal.attacks.model_updates",
    "labels_from_bias_gradient": "privfedcal.attacks.gradient_inversion",
    "matched_psnr": "privfedcal.attacks.metrics",
    "nearest_is_true": "privfedcal.attacks.metrics",
    "psnr": "privfedcal.attacks.metrics",
    "recover_from_class_gradient": "privfedcal.attacks.gradient_inversion",
    "score_class_sets": "privfedcal.attacks.class_inference",
    "split_class_gradient": "privfedcal.attacks.gradient_inversion",
    "ssim": "privfedcal.attacks.metrics",
    "LocalRecipe": "privfedcal.attacks.model_updates",
    "invert_model_update": "privfedcal.attacks.model_updates",
    "labels_from_update": "privfedcal.attacks.model_updates",
    "recover_rank_n": "privfedcal.attacks.gradient_inversion",
    "simulate_local_training": "privfedcal.attacks.model_updates",
    "eval_mode": "privfedcal.attacks.modes",
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
