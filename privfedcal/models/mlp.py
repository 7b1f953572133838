"""A two-layer perceptron for small inputs such as the 8x8 digits: flatten -> 256 ReLU ->
128 ReLU = z (d = 128) -> linear classifier."""

from __future__ import annotations

from torch import Tensor, nn

from privfedcal.models.feature_classifier import FeatureClassifier


class MLP(FeatureClassifier):
    """flatten -> fc 256 ReLU -> fc 128 ReLU = z, classifier 128 -> C."""

    def __init__(self, *, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
        )
        self.feature_dim = 128
        self.num_classes = num_classes
        self.classifier = nn.Linear(128, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)
