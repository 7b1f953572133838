"""MobileNetV2 (Sandler et al., CVPR 2018), the model CCVR uses for CIFAR-100 and CINIC-10,
built from torchvision's ``mobilenet_v2(weights=None)`` (no pretrained weights).

Our choices, which the papers leave open:
- z = torchvision's ``features`` + global average pool + flatten (d = 1280).
- torchvision's dropout (p = 0.2) before the last linear layer is dropped, so that z and
  the logits are deterministic functions of the input in training mode too (MOON, FedUV and
  the calibration statistics all read z). The classifier is torchvision's own last linear
  layer, with its initialisation (N(0, 0.01) weights, zero bias).
- For inputs of 32x32 or smaller the stem convolution's stride is 1 instead of 2 (common
  CIFAR practice: a 32x32 image would otherwise reach the last stage at 1x1).
- For ``in_channels != 3`` the stem convolution is rebuilt with that many input channels.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models import mobilenet_v2

from privfedcal.models.feature_classifier import FeatureClassifier


class MobileNetV2(FeatureClassifier):
    """torchvision MobileNetV2 split into ``features`` (d = 1280) and a linear classifier."""

    def __init__(self, *, num_classes: int, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        net = mobilenet_v2(weights=None, num_classes=num_classes)
        stem: nn.Conv2d = net.features[0][0]
        stride = 1 if image_size <= 32 else 2
        if in_channels != stem.in_channels or stride != stem.stride[0]:
            new_stem = nn.Conv2d(
                in_channels, stem.out_channels, 3, stride=stride, padding=1, bias=False
            )
            nn.init.kaiming_normal_(new_stem.weight, mode="fan_out")
            net.features[0][0] = new_stem
        self.body = net.features
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = net.last_channel
        self.num_classes = num_classes
        self.classifier = net.classifier[1]

    def features(self, x: Tensor) -> Tensor:
        return self.pool(self.body(x))
