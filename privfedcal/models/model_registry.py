"""Models found by name: ``create_model("cnn", num_classes=10, in_channels=3, image_size=32)``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.registry import Registry

#: a builder takes the keywords ``num_classes``, ``in_channels`` and ``image_size`` and
#: returns a fresh model
ModelBuilder = Callable[..., FeatureClassifier]

_HERE = "privfedcal.models"
#: every model by name (``--model``), each module imported on first lookup (torchvision's
#: model zoo, which MobileNetV2 needs, takes seconds to import); an extension adds its
#: builder with ``@MODELS.register(name)``
MODELS: Registry[ModelBuilder] = Registry("model", built_in={
    "cnn": f"{_HERE}.cnn:SimpleCNN",
    "digits-cnn": f"{_HERE}.cnn:DigitsCNN",
    "mlp": f"{_HERE}.mlp:MLP",
    "mobilenetv2": f"{_HERE}.mobilenet:MobileNetV2",
    "resnet18": f"{_HERE}.resnet:resnet18",
    "resnet18-plain": f"{_HERE}.resnet:resnet18_plain",
    "resnet8": f"{_HERE}.resnet:resnet8",
    "uv-cnn": f"{_HERE}.uvcnn:UVCNN",
})


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
    shape = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    if generator is None:
        return builder(**shape)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(**shape)
