"""Toy extractors for the attack tests: tiny, deterministic, CPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from privfedcal.models.feature_classifier import FeatureClassifier

MEAN, STD = [0.5], [0.25]  # pixels in [0,1] -> [-2, 2]


class ToyExtractor(FeatureClassifier):
    """Flatten -> Linear (-> tanh -> Linear) [-> BatchNorm1d]; 1 x 4 x 4 images."""

    def __init__(
        self,
        *,
        d: int = 32,
        mlp: bool = False,
        bn: bool = False,
        num_classes: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.feature_dim, self.num_classes = d, num_classes
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(16, d)]
        if mlp:
            layers += [nn.Tanh(), nn.Linear(d, d)]
        self.body = nn.Sequential(*layers)
        with torch.no_grad():
            for p in self.body.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.bn = nn.BatchNorm2d(1) if bn else None
        self.classifier = nn.Linear(d, num_classes)
        with torch.no_grad():
            for p in self.classifier.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def features(self, x: Tensor) -> Tensor:
        if self.bn is not None:
            x = self.bn(x)
        return self.body(x)


@pytest.fixture
def toy() -> type[ToyExtractor]:
    """The toy model class, to build variants (``toy(mlp=True, bn=True)``)."""
    return ToyExtractor


@pytest.fixture
def linear_model() -> ToyExtractor:
    return ToyExtractor(mlp=False)


@pytest.fixture
def mlp_model() -> ToyExtractor:
    return ToyExtractor(mlp=True)


@pytest.fixture
def images() -> Tensor:
    """Three 1x4x4 images in [0.05, 0.95] (so the box constraint is not active)."""
    return 0.05 + 0.9 * torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(7))
