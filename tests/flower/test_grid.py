"""privfedcal.flower.grid: the in-process Grid a user tests a Flower app with.

A tiny numpy-only app (no privfedcal model): each node's ClientApp adds its partition id to
the arrays it receives and counts its calls in its own ``context.state``; Flower's own
``FedAvg`` (Message API) runs over the grid, so the averages are known in closed form.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.grid import (  # noqa: E402
    NODE_BASE,
    InProcessGrid,
    app_run_config,
    over_the_wire,
    run_app,
)

client = ClientApp()
SEEN: list = []  # the ArrayRecords the ClientApp received (kept alive: ids stay distinct)


@client.train()
def train(msg: Message, context: Context) -> Message:
    SEEN.append(msg.content["arrays"])
    k = int(context.node_config["partition-id"])
    calls = context.state.get("calls", MetricRecord({"n": 0}))["n"] + 1
    context.state["calls"] = MetricRecord({"n": calls})
    w = msg.content["arrays"]["w"].numpy() + k
    metrics = MetricRecord({"num-examples": k + 1, "calls": calls,
                            "scale": float(context.run_config["scale"])})
    return Message(RecordDict({"arrays": ArrayRecord({"w": torch.from_numpy(w)}), "metrics": metrics}),
                   reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    raise RuntimeError(f"node {context.node_id} cannot evaluate")


server = ServerApp()


@server.main()
def main(grid, context: Context) -> None:
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=3)
    result = strategy.start(grid, ArrayRecord({"w": torch.zeros(2)}), num_rounds=2)
    context.state["final"] = result.arrays


def test_flowers_fedavg_runs_over_the_grid_with_per_node_state():
    grid = InProcessGrid(client, {"scale": 2.0}, 3)
    SEEN.clear()
    context = grid.run_server_app(server)
    # weights k+1 for node k: one round adds sum_k (k+1) k / sum_k (k+1) = 8/6
    expected = 2 * (0 * 1 + 1 * 2 + 2 * 3) / (1 + 2 + 3)
    assert np.allclose(context.state["final"]["w"].numpy(), [expected, expected])
    assert sorted(grid.get_node_ids()) == [NODE_BASE, NODE_BASE + 1, NODE_BASE + 2]
    for k, node in enumerate(sorted(grid.contexts)):
        ctx = grid.contexts[node]
        assert ctx.node_config == {"partition-id": k, "num-partitions": 3}
        assert ctx.run_config == {"scale": 2.0}
        assert ctx.state["calls"]["n"] == 2  # its own state, kept across the two rounds
    assert len(SEEN) == 6 and len({id(a) for a in SEEN}) == 6  # each delivery inflated a new object
    assert grid.bytes_sent > 0 and grid.bytes_received > 0
    assert grid.run.run_id == 1


def test_an_exception_in_the_clientapp_is_an_error_reply():
    grid = InProcessGrid(client, {}, 2, node_config={"data-seed": 7})
    assert grid.contexts[NODE_BASE + 1].node_config["data-seed"] == 7
    msg = Message(RecordDict(), NODE_BASE + 1, "evaluate", group_id="1")
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and not reply.has_content()
    assert "RuntimeError" in reply.error.reason
    assert f"node {NODE_BASE + 1} cannot evaluate" in reply.error.reason
    with pytest.raises(ValueError, match="no node 5"):
        grid.push_messages([Message(RecordDict(), 5, "train", group_id="1")])


def test_over_the_wire_is_a_copy_with_its_size():
    msg = Message(RecordDict({"a": ArrayRecord({"x": torch.arange(100.0, dtype=torch.float64)})}), 7, "train",
                  group_id="1")
    out, size = over_the_wire(msg)
    assert out is not msg and out.content["a"] is not msg.content["a"]
    assert np.array_equal(out.content["a"]["x"].numpy(), np.arange(100.0))
    assert size > 800  # 100 float64 and the records around them


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_node_counts_are_refused(bad):
    with pytest.raises(UsageError, match="num_nodes"):
        InProcessGrid(client, {}, bad)


def test_apps_are_refused_unless_flower_apps():
    with pytest.raises(UsageError, match="client_app must be a flwr ClientApp"):
        InProcessGrid(train, {}, 2)
    with pytest.raises(UsageError, match="server_app must be a flwr ServerApp"):
        InProcessGrid(client, {}, 2).run_server_app(main)


APP = """
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

client = ClientApp()
server = ServerApp()


@client.train()
def train(msg, context):
    w = msg.content["arrays"]["w"].numpy() + context.run_config["step"]
    return Message(RecordDict({"arrays": ArrayRecord({"w": torch.from_numpy(w)}),
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


@server.main()
def main(grid, context):
    result = FedAvg(fraction_evaluate=0.0).start(
        grid, ArrayRecord({"w": torch.zeros(1)}), num_rounds=context.run_config["rounds"])
    context.state["final"] = result.arrays
"""

PYPROJECT = """
[project]
name = "{name}"
version = "1.0.0"

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "{name}_mod:server"
clientapp = "{name}_mod:client"

[tool.flwr.app.config]
rounds = 1
step = 0.5
nested.key = "x"
"""


def write_app(root, name):
    root.mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT.format(name=name))
    (root / f"{name}_mod.py").write_text(textwrap.dedent(APP))
    return root


def test_run_app_loads_the_components_and_applies_declared_overrides(tmp_path):
    app = write_app(tmp_path / "app", "gridapp")
    assert app_run_config(app) == {"rounds": 1, "step": 0.5, "nested.key": "x"}
    context = run_app(app, 2, {"rounds": 3})
    assert context.run_config["rounds"] == 3
    assert np.allclose(context.state["final"]["w"].numpy(), [1.5])  # 3 rounds of +0.5


def test_run_app_refuses_undeclared_keys_and_non_apps(tmp_path):
    app = write_app(tmp_path / "app", "gridapp2")
    with pytest.raises(UsageError, match=r"declares no run-config key clients \(declared: "
                                         r"nested.key, rounds, step\)"):
        run_app(app, 2, {"clients": 2})
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="has no pyproject.toml"):
        run_app(tmp_path / "empty", 2)
    (tmp_path / "empty" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(UsageError, match=r"no \[tool.flwr.app\] table"):
        app_run_config(tmp_path / "empty")
