"""Models: every one exposes ``features(x) -> z`` and a linear ``classifier``."""

from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.models.model_registry import MODELS, create_model

__all__ = ["MODELS", "FeatureClassifier", "create_model"]
