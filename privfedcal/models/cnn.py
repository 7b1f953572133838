"""The simple CNN of the CCVR (Luo et al., NeurIPS 2021) and MOON (Li et al., CVPR 2021)
papers for CIFAR-10: two 5x5 conv+pool blocks, fc 400->120->84, then MOON's projection head
84->84->256 whose output is the representation z (d = 256) fed to the linear classifier.
"""

from __future__ import annotations

from torch import Tensor, nn

from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.settings.messages import SettingError, SettingText


def _conv_pool_size(image_size: int) -> int:
    """Spatial side after (5x5 valid conv, 2x2 max-pool) twice; 0 if the image is too small."""
    side = image_size
    for _ in range(2):
        side = (side - 4) // 2
        if side < 1:
            return 0
    return side


class SimpleCNN(FeatureClassifier):
    """conv in->6 (5x5) ReLU pool, conv 6->16 (5x5) ReLU pool, fc ->120 ReLU, fc 120->84 ReLU,
    projection fc 84->84 ReLU, fc 84->256 = z (no ReLU), classifier 256->C."""

    def __init__(self, *, num_classes: int, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        side = _conv_pool_size(image_size)
        if side == 0:
            raise SettingError(
                "model 'cnn' needs images of at least 16x16 pixels (got {image_size}x{image_size}); "
                "use {mlp} or {digits} for small images", image_size=image_size,
                mlp=SettingText("{model=}", model="mlp"),
                digits=SettingText("{model=}", model="digits-cnn"))
        self.convs = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.body = nn.Sequential(
            nn.Linear(16 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
        )
        # MOON's projection head; its output is the representation every method uses.
        self.projection = nn.Sequential(nn.Linear(84, 84), nn.ReLU(), nn.Linear(84, 256))
        self.feature_dim = 256
        self.num_classes = num_classes
        self.classifier = nn.Linear(256, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.projection(self.body(self.convs(x)))


class DigitsCNN(FeatureClassifier):
    """A small CNN for 8x8 digits: conv ->32 (3x3) ReLU, conv 32->64 (3x3) ReLU, pool 2,
    fc ->128 ReLU = z (d = 128)."""

    def __init__(self, *, num_classes: int, in_channels: int = 1, image_size: int = 8) -> None:
        super().__init__()
        side = image_size // 2
        if side < 1:
            raise UsageError(
                f"model 'digits-cnn' needs images of at least 2x2 pixels (got {image_size})"
            )
        self.convs = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(64 * side * side, 128), nn.ReLU())
        self.feature_dim = 128
        self.num_classes = num_classes
        self.classifier = nn.Linear(128, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.fc(self.convs(x))
