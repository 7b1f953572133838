"""The ClientApp: each node trains the global model on its own digits."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from privfedcal.flower.plugin import CalibrationClient
from quickstart.task import Net, test, train, trainloader

app = ClientApp()


def node_data(context: Context, shuffle: bool = True):
    """This node's training DataLoader, chosen by its partition id."""
    return trainloader(int(context.node_config["partition-id"]),
                       int(context.node_config["num-partitions"]),
                       float(context.run_config["alpha"]), shuffle=shuffle)


@app.train(mods=[fixedclipping_mod])
def fit(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    # the local shuffle from (round, node): a run is reproducible, whichever node runs where
    torch.manual_seed(1000 * int(msg.content["config"]["server-round"])
                      + int(context.node_config["partition-id"]))
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = node_data(context)
    loss = train(model, loader, int(context.run_config["local-epochs"]),
                 float(msg.content["config"]["lr"]))
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(loader.dataset)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}),
                   reply_to=msg)


CalibrationClient(Net, node_data, head="fc3").attach(app)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = node_data(context, shuffle=False)
    loss, accuracy = test(model, loader)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": accuracy,
                            "num-examples": len(loader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
