"""The model, the data and the training loop of the app.

The data are privfedcal's digits (8x8 grey images, 10 classes; shipped with scikit-learn,
so nothing is downloaded), split over the nodes with Dirichlet label skew: each node sees a
few classes mostly, the setting where FedAvg's classifier head drifts and calibration helps.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privfedcal.data.datasets import load_dataset
from privfedcal.data.partition import PartitionSpec, partition_indices

DATA_SEED = 0  # the split of the digits over the nodes


class Net(nn.Module):
    """Two convolutions and three fully connected layers; ``fc3`` gives the class scores."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x))).flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


@cache
def _digits():
    return load_dataset("digits")


@cache
def _parts(num_partitions: int, alpha: float) -> list:
    labels = _digits().y_train.numpy()
    return partition_indices(labels, PartitionSpec("dirichlet", num_partitions, alpha=alpha),
                             seed=DATA_SEED)


def trainloader(partition_id: int, num_partitions: int, alpha: float,
                shuffle: bool = True) -> DataLoader:
    """The training samples of node ``partition_id`` of ``num_partitions``."""
    d = _digits()
    idx = torch.from_numpy(_parts(num_partitions, alpha)[partition_id])
    return DataLoader(TensorDataset(d.x_train[idx], d.y_train[idx]), batch_size=32,
                      shuffle=shuffle)


def testloader() -> DataLoader:
    """The held-out digits, for the server's evaluation."""
    d = _digits()
    return DataLoader(TensorDataset(d.x_test, d.y_test), batch_size=256)


def train(model: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    """Local SGD; returns the mean training loss of the last epoch."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for _ in range(epochs):
        total, n = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(y), n + len(y)
    return total / max(n, 1)


def test(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``loader``."""
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            n += len(y)
    return loss / n, correct / n
