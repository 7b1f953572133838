"""The contract every model honours: ``features(x) -> z`` and a linear ``classifier``.

Methods (MOON, FedUV, clsnorm) and calibrators (CCVR, CReFF) only ever touch a model through
``features`` and ``classifier``, so each of them works on every registered architecture.
"""

from __future__ import annotations

from torch import Tensor, nn


class FeatureClassifier(nn.Module):
    """Feature extractor ``f`` (image -> z in R^d) followed by a linear classifier ``g``."""

    feature_dim: int
    num_classes: int
    classifier: nn.Linear

    def features(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    def extractor_parameters(self):
        """Parameters of the feature extractor (everything but the classifier)."""
        cls = {id(p) for p in self.classifier.parameters()}
        return [p for p in self.parameters() if id(p) not in cls]
