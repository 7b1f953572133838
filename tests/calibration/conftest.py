"""Fixtures for the calibration tests: a tiny model and a small in-process ServerContext.

``FakeContext`` implements the ``ServerContext`` contract of federation/hooks.py the plain way
(loop over clients, sum their payloads, accuracy on a test set); it is a fixture for the
contract, not a stand-in for any library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.bound import NoBound

torch.set_num_threads(1)


class TinyModel(FeatureClassifier):
    """features(x) = A x (A = identity at start), then a linear classifier."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.feature_dim, self.num_classes = dim, num_classes
        self.extractor = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.extractor.weight.copy_(torch.eye(dim))
        self.classifier = nn.Linear(dim, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.extractor(x)


class RowNormalize(nn.Module):
    """clsnorm's parametrisation: unit-norm classifier rows."""

    def forward(self, w: Tensor) -> Tensor:
        return w / w.norm(dim=1, keepdim=True)


class NormBound:
    """Clips every per-sample row to L2 norm <= radius."""

    def __init__(self, radius: float) -> None:
        self.radius = radius
        self.kinds: list[str] = []

    def clip(self, rows: Tensor, kind: str) -> Tensor:
        self.kinds.append(kind)
        flat = rows.reshape(rows.shape[0], -1)
        scale = (self.radius / flat.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
        return (flat * scale[:, None]).reshape(rows.shape)


@dataclass
class FakeContext:
    model: FeatureClassifier
    clients: list[tuple[Tensor, Tensor]]
    test: tuple[Tensor, Tensor]
    global_state: dict[str, Tensor]
    num_classes: int
    generator: torch.Generator
    round: int = 1
    selected: list[int] = field(default_factory=list)
    sent_state: dict[str, Tensor] | None = None
    bound: Any = field(default_factory=NoBound)
    device: torch.device = torch.device("cpu")
    labels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sent_state is None:
            self.sent_state = self.global_state
        if not self.selected:
            self.selected = list(range(len(self.clients)))

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def collect(self, task, clients, state, label):
        self.labels.append(label)
        self.model.load_state_dict(state)
        self.model.eval()
        total: dict[str, Tensor] = {}
        for k in clients:
            x, y = self.clients[k]
            payload = task.compute(self.model, x, y, self.bound)
            for key, value in payload.items():
                total[key] = total[key] + value if key in total else value.clone()
        return total

    def centralized_features(self, state, per_class):
        self.model.load_state_dict(state)
        x = torch.cat([c[0] for c in self.clients])
        y = torch.cat([c[1] for c in self.clients])
        if per_class is not None:
            keep = torch.cat([torch.nonzero(y == c).flatten()[:per_class]
                              for c in range(self.num_classes)])
            x, y = x[keep], y[keep]
        with torch.no_grad():
            return self.model.features(x), y

    def evaluate(self, state, transform=None):
        self.model.load_state_dict(state)
        x, y = self.test
        with torch.no_grad():
            z = self.model.features(x)
            if transform is not None:
                z = transform(z)
            pred = self.model.classifier(z).argmax(1)
        per_class = [float((pred[y == c] == c).float().mean()) for c in range(self.num_classes)]
        return {"accuracy": float((pred == y).float().mean()), "loss": 0.0,
                "per_class_accuracy": per_class}


def blobs(n_per_class: list[int], dim: int, seed: int, sep: float = 3.0) -> tuple[Tensor, Tensor]:
    """Gaussian blobs: class c centred at sep * e_c, unit variance."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in enumerate(n_per_class)])
    centres = sep * torch.eye(len(n_per_class), dim)
    x = centres[ys] + torch.randn(len(ys), dim, generator=g)
    return x, ys


def make_biased_context(*, normalized: bool = False, seed: int = 0) -> FakeContext:
    """3 classes in 4-d, separable; 3 skewed clients (one holds a single sample of class 2);
    the classifier points the right way but its bias strongly favours class 0."""
    dim, num_classes = 4, 3
    clients = [blobs([60, 5, 0], dim, seed), blobs([5, 50, 1], dim, seed + 1),
               blobs([10, 0, 40], dim, seed + 2), blobs([0, 0, 1], dim, seed + 3)]
    test = blobs([100, 100, 100], dim, seed + 10)
    model = TinyModel(dim, num_classes)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.eye(num_classes, dim))
        model.classifier.bias.copy_(torch.tensor([6.0, 0.0, 0.0]))
    if normalized:
        # clsnorm: zero bias; rows 1 and 2 point away from their classes, so only class 0
        # is recognised before calibration (accuracy about 1/3)
        parametrize.register_parametrization(model.classifier, "weight", RowNormalize())
        with torch.no_grad():
            model.classifier.bias.zero_()
            model.classifier.parametrizations.weight.original.copy_(
                torch.diag(torch.tensor([1.0, -1.0, -1.0])) @ torch.eye(num_classes, dim))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return FakeContext(model, clients, test, state, num_classes,
                       torch.Generator().manual_seed(1234))


@pytest.fixture
def biased_context() -> FakeContext:
    return make_biased_context()


@pytest.fixture
def make_context():
    """Factory: ``make_context(normalized=False, seed=0)`` -> FakeContext (biased head)."""
    return make_biased_context


@pytest.fixture
def helpers() -> SimpleNamespace:
    """The fixture classes/functions above, for tests that build their own cases."""
    return SimpleNamespace(TinyModel=TinyModel, NormBound=NormBound, FakeContext=FakeContext,
                           blobs=blobs, RowNormalize=RowNormalize)
