"""A Flower app of a user's own for the plugin tests: a small CNN whose head is ``fc3``
(not a privfedcal model), DataLoaders over the digits, Flower's ``FedAvg``, and privfedcal's
calibration added by ``CalibrationClient(...).attach(app)`` and ``calibrate(...)``."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from privfedcal.data.datasets import load_dataset
from privfedcal.data.partition import PartitionSpec, partition_indices
from privfedcal.flower.plugin import CalibrationClient

NODES = 3


class Net(nn.Module):
    """The user's CNN: two convolutions, three Linear layers, the last (``fc3``) the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x))).flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class DictDigits(Dataset):
    """Samples as mappings, as Flower Datasets gives them (``{"img": ..., "label": ...}``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"img": self.x[i], "label": self.y[i]}


@lru_cache(maxsize=1)
def digits():
    return load_dataset("digits")


def trainloader(partition: int, shuffle: bool = False) -> DataLoader:
    d = digits()
    parts = partition_indices(d.y_train.numpy(), PartitionSpec("dirichlet", NODES, alpha=0.5),
                              seed=0)
    idx = torch.from_numpy(parts[partition])
    return DataLoader(TensorDataset(d.x_train[idx], d.y_train[idx]), batch_size=64,
                      shuffle=shuffle)


def eval_loader() -> DataLoader:
    d = digits()
    return DataLoader(DictDigits(d.x_test, d.y_test), batch_size=128)


def node_data(context: Context) -> DataLoader:
    return trainloader(int(context.node_config["partition-id"]))


def make_client_app(**settings) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.manual_seed(int(context.node_config["partition-id"]))
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = trainloader(int(context.node_config["partition-id"]), shuffle=True)
        for _ in range(2):
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(loader.dataset)})}),
                       reply_to=msg)

    CalibrationClient(Net, node_data, head="fc3", **settings).attach(app)
    return app


def fedavg(grid, rounds: int = 3) -> Net:
    """Flower's FedAvg over ``grid``: the trained model."""
    torch.manual_seed(0)
    model = Net()
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=rounds)
    model.load_state_dict(result.arrays.to_torch_state_dict())
    return model
