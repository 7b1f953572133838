"""CIFAR-style ResNets (He et al., CVPR 2016): a 3x3 stem without max-pool, BasicBlocks.

- ``resnet8``: the ResNet-8 of CReFF (Shang et al., IJCAI 2022) as its authors' code builds
  it (a CIFAR ResNet of depth 8 with width scaling 4): 64-channel 3x3 stem, three stages of
  one BasicBlock with 64/128/256 channels (strides 1/2/2), global average pooling, d = 256.
  Convolutions are initialised N(0, 2/(k*k*out_channels)) as in that code.
- ``resnet18``: the CIFAR ResNet-18 of FedUV (Son et al., CVPR 2024): 64-channel 3x3 stem,
  no max-pool, four stages of two BasicBlocks (64/128/256/512), then FedUV's projector of two
  fully connected layers, each Linear(512) -> BatchNorm1d -> ReLU; z is the projector's
  output (d = 512), on which FedUV's uniformity loss acts and the classifier reads.
  ``resnet18-plain`` is the same network without the projector (z = pooled features).
Shortcuts are identity, or 1x1 conv + BatchNorm where the shape changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.models.uvcnn import bn_projector


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(FeatureClassifier):
    """Stem conv 3x3 -> BN -> ReLU, stages of BasicBlocks, global average pool = z."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int,
        widths: Sequence[int],
        blocks: Sequence[int],
        strides: Sequence[int],
        projector: int = 0,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        in_planes = widths[0]
        for width, count, stride in zip(widths, blocks, strides, strict=True):
            for i in range(count):
                layers.append(BasicBlock(in_planes, width, stride if i == 0 else 1))
                in_planes = width
        self.stages = nn.Sequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projector: nn.Module = nn.Identity()
        if projector:
            self.projector = bn_projector(in_planes, projector)
            in_planes = projector
        self.feature_dim = in_planes
        self.num_classes = num_classes
        self.classifier = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def features(self, x: Tensor) -> Tensor:
        return self.projector(self.pool(self.stages(self.stem(x))))


def resnet8(*, num_classes: int, in_channels: int = 3, image_size: int | None = None) -> CifarResNet:
    """ResNet-8; any ``image_size`` works (global pooling before the head)."""
    return CifarResNet(
        num_classes=num_classes,
        in_channels=in_channels,
        widths=(64, 128, 256),
        blocks=(1, 1, 1),
        strides=(1, 2, 2),
    )


def resnet18(*, num_classes: int, in_channels: int = 3, projector: bool = True,
             image_size: int | None = None) -> CifarResNet:
    """ResNet-18 with a 512-wide projector (``projector=False``: none); any ``image_size``
    works (global pooling before the head)."""
    return CifarResNet(
        num_classes=num_classes,
        in_channels=in_channels,
        widths=(64, 128, 256, 512),
        blocks=(2, 2, 2, 2),
        strides=(1, 2, 2, 2),
        projector=512 if projector else 0,
    )


def resnet18_plain(*, num_classes: int, in_channels: int = 3,
                   image_size: int | None = None) -> CifarResNet:
    """ResNet-18 without the projector: the pooled features feed the head directly."""
    return resnet18(num_classes=num_classes, in_channels=in_channels, projector=False)
