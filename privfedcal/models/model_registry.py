"""Models found by name: ``create_model("cnn", num_classes=10, in_channels=3, image_size=32)``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from privfedcal.errors import UsageError
from privfedcal.models.cnn import DigitsCNN, SimpleCNN
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.models.mlp import MLP
from privfedcal.models.resnet import resnet8, resnet18
from privfedcal.models.uvcnn import UVCNN
from privfedcal.registry import Registry

#: a builder takes (num_classes, in_channels, image_size) and returns a fresh model
ModelBuilder = Callable[[int, int, int], FeatureClassifier]

MODELS: Registry[ModelBuilder] = Registry("model")

MODELS.register("cnn")(lambda c, ch, s: SimpleCNN(num_classes=c, in_channels=ch, image_size=s))
MODELS.register("digits-cnn")(
    lambda c, ch, s: DigitsCNN(num_classes=c, in_channels=ch, image_size=s)
)
MODELS.register("mlp")(lambda c, ch, s: MLP(num_classes=c, in_channels=ch, image_size=s))
MODELS.register("uv-cnn")(lambda c, ch, s: UVCNN(num_classes=c, in_channels=ch, image_size=s))
MODELS.register("resnet8")(lambda c, ch, s: resnet8(num_classes=c, in_channels=ch))
MODELS.register("resnet18")(lambda c, ch, s: resnet18(num_classes=c, in_channels=ch))
MODELS.register("resnet18-plain")(
    lambda c, ch, s: resnet18(num_classes=c, in_channels=ch, projector=False)
)


@MODELS.register("mobilenetv2")
def _mobilenetv2(c: int, ch: int, s: int) -> FeatureClassifier:
    # imported here: torchvision's model zoo takes seconds to import and only this model needs it
    from privfedcal.models.mobilenet import MobileNetV2

    return MobileNetV2(num_classes=c, in_channels=ch, image_size=s)


def create_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    generator: torch.Generator | None = None,
) -> FeatureClassifier:
    """Build a registered model; an unknown name raises a UsageError listing the choices.

    Initial weights come from torch's default initialisers. With ``generator`` they are
    drawn under a forked RNG seeded from it, so the build is reproducible and the global
    RNG is left untouched; without it the global RNG is used (and advanced).
    """
    builder = MODELS.get(name)
    for label, value, low in (
        ("num_classes", num_classes, 2),
        ("in_channels", in_channels, 1),
        ("image_size", image_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"model {name!r}: {label} must be an integer >= {low}, got {value!r}")
    if generator is None:
        return builder(num_classes, in_channels, image_size)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(num_classes, in_channels, image_size)
