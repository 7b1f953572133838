"""privfedcal's CCVR calibration with its DP release, from a Flower app of one's own.

A Flower user's app, not privfedcal's: the ``ClientApp`` trains a privfedcal model (the
digits MLP) with plain local SGD, the ``ServerApp`` runs Flower's own ``FedAvg`` strategy
(``strategy.start``) and, once it returns, calibrates the final model with CCVR:

1. the server sends every node one ``query`` message carrying the final model;
2. each node computes ``privfedcal.ccvr_statistics`` of its data under that model (features
   clipped to ``clip``), privatizes them with ``privfedcal.privatize_statistics`` (one
   (epsilon, delta)-DP release) and replies with them as an ``ArrayRecord``;
3. the server sums the replies and calls ``privfedcal.calibrate_head``.

Every message holds Flower records only (``ArrayRecord`` of numpy arrays, ``MetricRecord``,
``ConfigRecord``): no pickles cross the wire.

Data: each node loads the digits shipped with privfedcal and keeps its share of a Dirichlet
label-skew split (``alpha``) of the training set, the ``partition-id``-th of
``num-partitions`` parts drawn with the node config's ``data-seed`` (default 0). This stands
in for a node's own private data; a real node would load that instead. The server never
needs the seed: it holds the public test set only.

Settings come from the run config (keys of ``SETTINGS``; ``flwr run --run-config`` overrides
them). The DP settings (``epsilon``, ``delta``, ``clip``) are read by each client from its
own run config, never from the server's message, so a server cannot ask a client for a
weaker release; ``epsilon = inf`` turns the noise off. A client answers one query per run:
each answer would be one more release of its data. The DP guarantee covers that release
only: the FedAvg rounds before it (model updates, ``num-examples``) are plain Flower
training, unprotected (``privfedcal train --dp-train --dp-eps`` protects both).

Run it in this process over privfedcal's ``LoopbackGrid`` (3 nodes, messages serialised as
through a SuperLink)::

    python examples/own_strategy.py

or as a Flower app against real SuperNodes (``docs/api.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

import privfedcal
from privfedcal.data.datasets import Dataset, load_dataset
from privfedcal.data.partition import PartitionSpec, partition_indices
from privfedcal.models import FeatureClassifier, create_model

#: the run config keys this app reads, with their defaults
SETTINGS: dict[str, Any] = {
    "num-server-rounds": 2,
    "local-epochs": 1,
    "lr": 0.05,
    "batch-size": 32,
    "alpha": 0.5,  # Dirichlet concentration of the label skew
    "seed": 0,  # model initialisation and local shuffling (public)
    "clip": 8.0,  # bound on each feature's L2 norm: about the largest of this model's
    "epsilon": 8.0,  # one (epsilon, delta)-DP release per client; inf: no noise
    "delta": 1e-5,
    "virtual-per-class": 200,  # virtual features per class of the head's re-training
}

RELEASED = "own-strategy.released"  # the client's note that it has answered its query


def settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``SETTINGS`` overridden by the run config's entries of the same names."""
    return {k: type(v)(run_config.get(k, v)) for k, v in SETTINGS.items()}


@lru_cache(maxsize=1)
def digits() -> Dataset:
    # the digits ship inside privfedcal: nothing is downloaded; cached for the process
    return load_dataset("digits")


def new_model(data: Dataset, seed: int) -> FeatureClassifier:
    """privfedcal's default model of the digits (an MLP; ``features`` + ``classifier``)."""
    return create_model("mlp", num_classes=data.num_classes, in_channels=data.in_channels,
                        image_size=data.image_size,
                        generator=torch.Generator().manual_seed(seed))


def accuracy(model: FeatureClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


# ---- client ------------------------------------------------------------------------------

def node_partition(context: Context, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This node's (x, y): part ``partition-id`` of ``num-partitions`` of a Dirichlet split
    of the digits' training set, drawn with the node config's ``data-seed`` (default 0)."""
    nc = context.node_config
    k, n = int(nc["partition-id"]), int(nc["num-partitions"])
    data = digits()
    parts = partition_indices(data.y_train.numpy(),
                              PartitionSpec("dirichlet", num_clients=n, alpha=alpha),
                              seed=int(nc.get("data-seed", 0)))
    idx = torch.from_numpy(parts[k])
    return data.x_train[idx], data.y_train[idx]


def local_sgd(model: FeatureClassifier, x: torch.Tensor, y: torch.Tensor, *, epochs: int,
              lr: float, batch_size: int, generator: torch.Generator) -> float:
    """Plain minibatch SGD on cross-entropy; returns the mean loss of the last epoch."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    losses: list[float] = []
    for _ in range(epochs):
        losses = []
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return float(np.mean(losses))


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    s = settings(context.run_config)
    x, y = node_partition(context, s["alpha"])
    model = new_model(digits(), s["seed"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    # shuffles differ per node and round, and repeat when the run is repeated
    round_ = int(msg.content["config"]["server-round"])
    g = torch.Generator().manual_seed(s["seed"] * 1_000_003 + round_ * 1009
                                      + int(context.node_config["partition-id"]))
    loss = local_sgd(model, x, y, epochs=s["local-epochs"], lr=s["lr"],
                     batch_size=s["batch-size"], generator=g)
    # FedAvg wants one ArrayRecord and one MetricRecord holding its weight key
    return Message(RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"num-examples": len(y), "train-loss": loss}),
    }), reply_to=msg)


@client.query()
def query(msg: Message, context: Context) -> Message:
    """CCVR's client half: the node's class statistics under the received model, clipped
    and privatized here, before they leave the node."""
    if RELEASED in context.state.config_records:
        raise RuntimeError("this node has already released its statistics in this run")
    s = settings(context.run_config)
    x, y = node_partition(context, s["alpha"])
    data = digits()
    model = new_model(data, s["seed"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    stats = privfedcal.ccvr_statistics(model, x, y, data.num_classes, clip=s["clip"])
    if math.isfinite(s["epsilon"]):
        stats = privfedcal.privatize_statistics(stats, epsilon=s["epsilon"],
                                                delta=s["delta"], clip=s["clip"])
    context.state[RELEASED] = ConfigRecord({"epsilon": s["epsilon"]})
    # count (C,), sum (C, d), outer (C, d, d): numpy arrays inside an ArrayRecord
    return Message(RecordDict({"statistics": ArrayRecord(stats)}), reply_to=msg)


# ---- server ------------------------------------------------------------------------------

def collect_statistics(grid: Grid, arrays: ArrayRecord,
                       timeout: float = 3600) -> dict[int, dict[str, torch.Tensor]]:
    """Send the model to every node in a query message; each node's statistics by node id.
    A failed node fails the calibration: a sum without it would be the wrong one."""
    messages = [Message(RecordDict({"arrays": arrays}), dst_node_id=node,
                        message_type=MessageType.QUERY)
                for node in grid.get_node_ids()]
    uploads = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise RuntimeError(f"node {node} failed its query: {reply.error.reason}")
        uploads[node] = reply.content["statistics"].to_torch_state_dict()
    if len(uploads) != len(messages):
        raise RuntimeError(f"{len(messages) - len(uploads)} nodes did not answer the query")
    return uploads


def run(grid: Grid, context: Context) -> dict[str, Any]:
    """FedAvg for ``num-server-rounds`` rounds, then CCVR; returns what it printed, with the
    nodes' statistics (``uploads``, by node id) and their sum (``total``)."""
    s = settings(context.run_config)
    data = digits()  # the server uses the test set only
    model = new_model(data, s["seed"])
    nodes = len(list(grid.get_node_ids()))
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes,
                      min_available_nodes=nodes)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=s["num-server-rounds"])
    model.load_state_dict(result.arrays.to_torch_state_dict())
    before = accuracy(model, data.x_test, data.y_test)

    uploads = collect_statistics(grid, result.arrays)
    total = {k: sum(u[k] for u in uploads.values()) for k in ("count", "sum", "outer")}
    privfedcal.calibrate_head(model, total, virtual_per_class=s["virtual-per-class"],
                              seed=s["seed"])
    after = accuracy(model, data.x_test, data.y_test)
    print(f"test accuracy: FedAvg {before:.3f}, after CCVR calibration {after:.3f} "
          f"(epsilon={s['epsilon']:g} per client)")
    return {"before": before, "after": after, "uploads": uploads, "total": total,
            "model": model}


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    out = run(grid, context)
    # kept in the ServerApp's context: for whoever runs it in-process (the tests)
    context.state["ccvr.accuracy"] = MetricRecord({"before": out["before"],
                                                   "after": out["after"]})
    context.state["ccvr.statistics"] = ArrayRecord(out["total"])
    context.state["ccvr.model"] = ArrayRecord(out["model"].state_dict())


if __name__ == "__main__":
    # in-process: privfedcal's InProcessGrid runs the ClientApp for 3 nodes (docs/flower.md)
    from privfedcal.flower.grid import InProcessGrid

    torch.set_num_threads(1)
    InProcessGrid(client, {}, 3).run_server_app(server)
