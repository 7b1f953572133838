"""Attacks on what an honest-but-curious server sees: feature and gradient inversion,
class-set inference, and the metrics that score them (pure functions; the CLI wraps them)."""

from privfedcal.attacks.class_inference import count_lower_bound, infer_classes, score
from privfedcal.attacks.feature_inversion import (
    FeatureTarget,
    InversionConfig,
    InversionResult,
    features_from_stats,
    invert_features,
)
from privfedcal.attacks.gradient_inversion import (
    GradientInversionResult,
    LabelInfo,
    invert_class_gradient,
    invert_update,
    labels_from_bias_gradient,
    recover_from_class_gradient,
    split_class_gradient,
)
from privfedcal.attacks.metrics import (
    best_match,
    feature_cosine,
    matched_psnr,
    nearest_is_true,
    psnr,
    ssim,
)

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
    "invert_update",
    "labels_from_bias_gradient",
    "matched_psnr",
    "nearest_is_true",
    "psnr",
    "recover_from_class_gradient",
    "score",
    "split_class_gradient",
    "ssim",
]
