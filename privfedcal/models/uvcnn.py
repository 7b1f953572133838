"""The small CNN of FedUV's public code (sonhamin/FedUV, ``simple-cnn``), written here from its
layer list, with the same BN projector as FedUV's ResNets.

Eight 3x3/1x1 convolutions, each followed by BatchNorm2d and ReLU (channels 16, 16, 32 s2, 32,
32, 64 s2, 64, 64; valid padding, no bias), global average pooling, then the projector of two
fully connected layers Linear -> BatchNorm1d -> ReLU (``proj_dim`` units, 256 as the authors'
default ``out_dim``). z is the projector's output: FedUV's L_U acts on it and the linear
classifier reads it. Any image of at least 15x15 pixels fits (global pooling).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.settings.messages import SettingError


class ProjectorBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d that normalises a training batch of ONE row with its running statistics
    (and leaves them unchanged) instead of raising: batch statistics of one row are undefined,
    and a client holding a single sample trains on it (docs/methods.md)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training and x.shape[0] == 1 and self.running_mean is not None:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                training=False, eps=self.eps)
        return super().forward(x)


def bn_projector(in_dim: int, out_dim: int) -> nn.Sequential:
    """FedUV's projector: (Linear -> BatchNorm1d -> ReLU) twice."""
    return nn.Sequential(
        nn.Linear(in_dim, out_dim), ProjectorBatchNorm(out_dim), nn.ReLU(),
        nn.Linear(out_dim, out_dim), ProjectorBatchNorm(out_dim), nn.ReLU(),
    )


def _valid_side(image_size: int) -> int:
    """Spatial side after the eight convolutions (3x3 valid convs, two with stride 2)."""
    side = image_size - 2  # conv1 3x3
    side = (side - 3) // 2 + 1  # conv3 3x3 s2
    side = side - 2  # conv4 3x3
    side = (side - 3) // 2 + 1  # conv6 3x3 s2
    return side - 2  # conv7 3x3


class UVCNN(FeatureClassifier):
    """FedUV's small CNN (width 1) with its BN projector; z = projector output (d = proj_dim)."""

    def __init__(
        self, *, num_classes: int, in_channels: int = 3, image_size: int = 32, proj_dim: int = 256
    ) -> None:
        super().__init__()
        if _valid_side(image_size) < 1:
            raise SettingError(
                "model 'uv-cnn' needs images of at least 15x15 pixels (got {image_size}); "
                "use {model=} or mlp for small images", image_size=image_size, model="digits-cnn")
        layers: list[nn.Module] = []
        # (out channels, kernel, stride) of the authors' eight convolutions
        plan = [(16, 3, 1), (16, 1, 1), (32, 3, 2), (32, 3, 1), (32, 1, 1),
                (64, 3, 2), (64, 3, 1), (64, 1, 1)]
        channels = in_channels
        for out, kernel, stride in plan:
            layers += [nn.Conv2d(channels, out, kernel, stride=stride, bias=False),
                       nn.BatchNorm2d(out), nn.ReLU()]
            channels = out
        self.convs = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projector = bn_projector(channels, proj_dim)
        self.feature_dim = proj_dim
        self.num_classes = num_classes
        self.classifier = nn.Linear(proj_dim, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.projector(self.convs(x))
