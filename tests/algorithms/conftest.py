"""Tiny models and batches for the method tests."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from privfedcal.models import create_model
from privfedcal.models.feature_classifier import FeatureClassifier

torch.set_num_threads(1)

NUM_CLASSES = 3


class TinyBN(FeatureClassifier):
    """Linear 4->8, BatchNorm, ReLU = z (d = 8), classifier 8->3: a model with BN buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.feature_dim = 8
        self.num_classes = NUM_CLASSES
        self.classifier = nn.Linear(8, NUM_CLASSES)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x.flatten(1))


def _make_mlp(seed: int = 0) -> FeatureClassifier:
    return create_model(
        "mlp",
        num_classes=NUM_CLASSES,
        in_channels=1,
        image_size=2,
        generator=torch.Generator().manual_seed(seed),
    )


def _make_batch(n: int = 6, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 2, 2, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return x, y


@pytest.fixture
def mlp() -> FeatureClassifier:
    return _make_mlp()


@pytest.fixture
def batch() -> tuple[Tensor, Tensor]:
    return _make_batch()


def _perturb(model: nn.Module, seed: int = 1, scale: float = 0.1) -> None:
    """Add a known random perturbation to every parameter, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.fixture
def make_mlp():
    """Factory: a tiny MLP (2x2 grey images, d = 128, 3 classes) built from ``seed``."""
    return _make_mlp


@pytest.fixture
def make_batch():
    """Factory: ``(x, y)`` of ``n`` 2x2 grey images and labels in 0..2, from ``seed``."""
    return _make_batch


@pytest.fixture
def perturb():
    """Function adding a seeded Gaussian perturbation to every parameter of a model."""
    return _perturb


@pytest.fixture
def tiny_bn() -> FeatureClassifier:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyBN()
