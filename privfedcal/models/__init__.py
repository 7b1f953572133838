"""Models: every one exposes ``features(x) -> z`` and a linear ``classifier``."""

from privfedcal.models.base import FeatureClassifier
from privfedcal.models.registry import MODELS, create_model

__all__ = ["MODELS", "FeatureClassifier", "create_model"]
