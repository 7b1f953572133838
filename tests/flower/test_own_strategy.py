"""examples/own_strategy.py: Flower's FedAvg with privfedcal's CCVR calibration afterwards.

The example's ServerApp and ClientApp run over a ``LoopbackGrid`` (3 nodes, digits, 2
rounds; every message serialised as through a SuperLink), once without noise, where the
statistics the server sums must be exactly the nodes' class counts, and once with the
example's DP release, where they must be those counts plus noise of the planned size.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import (  # noqa: E402
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from loopback import LoopbackGrid  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_strategy.py"
NODES = 3


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("own_strategy_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordingGrid(LoopbackGrid):
    """A loopback grid that keeps every message it delivers and every reply it returns."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.sent.extend(messages)
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.replies.extend(replies)
        return replies


def run_example(example, **run_config):
    """Run the example's ServerApp (its ``main``) over a recording loopback grid; returns
    what its main kept in the context (accuracies, summed statistics, final model), each
    node's statistics as they arrived (by node id), and the grid."""
    grid = RecordingGrid(example.client, run_config, NODES)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                  run_config=run_config)
    example.server(grid, ctx)
    out = {**ctx.state["ccvr.accuracy"],
           "total": ctx.state["ccvr.statistics"].to_torch_state_dict(),
           "model": ctx.state["ccvr.model"].to_torch_state_dict()}
    uploads = {r.metadata.src_node_id: r.content["statistics"].to_torch_state_dict()
               for r in grid.replies if r.metadata.message_type == MessageType.QUERY}
    return out, uploads, grid


def true_counts(example, grid) -> dict[int, torch.Tensor]:
    """Each node's class counts, from its partition as the node draws it."""
    alpha = example.SETTINGS["alpha"]
    return {node: torch.bincount(example.node_partition(ctx, alpha)[1], minlength=10)
            for node, ctx in grid.contexts.items()}


@pytest.fixture(scope="module")
def noise_free(example):
    return run_example(example, epsilon=math.inf)


@pytest.fixture(scope="module")
def private(example):
    return run_example(example)  # the example's default: epsilon 8 per client


def test_noise_free_statistics_are_the_partitions(example, noise_free):
    out, uploads, grid = noise_free
    counts = true_counts(example, grid)
    assert set(uploads) == set(grid.contexts)
    for node, stats in uploads.items():
        assert torch.equal(stats["count"].round().long(), counts[node])
        assert stats["count"].sum().item() == len(example.node_partition(
            grid.contexts[node], example.SETTINGS["alpha"])[1])
    total = sum(counts.values())
    assert torch.equal(out["total"]["count"].long(), total)  # what the server summed
    for key in ("sum", "outer"):
        assert torch.allclose(out["total"][key], sum(u[key] for u in uploads.values()))
    assert total.sum().item() == len(example.digits().y_train)  # every sample on one node
    assert 0.0 <= out["before"] <= 1.0 and 0.0 <= out["after"] <= 1.0
    assert out["after"] > out["before"]  # calibration helps FedAvg under label skew


def test_private_statistics_are_the_partitions_plus_planned_noise(example, private):
    from privfedcal.privacy.accounting import ReleasePlan, plan_noise

    out, uploads, grid = private
    s = example.SETTINGS
    (sigma,) = plan_noise(s["epsilon"], s["delta"], [ReleasePlan("ccvr-stats", 1.0, 1)])
    std = sigma * 3 ** 0.5  # count, sum, outer in equal shares; the count's sensitivity 1
    counts = true_counts(example, grid)
    for node, stats in uploads.items():
        diff = stats["count"] - counts[node].double()
        assert diff.abs().max().item() < 6 * std  # 60 draws: 6 std is never reached
        assert diff.abs().sum().item() > 0  # but noise was added
    for key in ("count", "sum", "outer"):  # the server summed the noisy statistics
        assert torch.allclose(out["total"][key], sum(u[key] for u in uploads.values()))
    assert math.isfinite(out["after"]) and 0.0 <= out["after"] <= 1.0
    assert all(torch.isfinite(p).all() for p in out["model"].values())


def test_every_message_holds_records_never_pickles(private):
    _, _, grid = private
    kinds = {m.metadata.message_type for m in grid.sent}
    assert kinds == {MessageType.TRAIN, MessageType.QUERY}
    assert len(grid.replies) == len(grid.sent) and not any(r.has_error() for r in grid.replies)
    for msg in grid.sent + grid.replies:
        for name, record in msg.content.items():
            assert isinstance(record, ArrayRecord | MetricRecord | ConfigRecord), name
            for key, value in record.items():
                if isinstance(record, ArrayRecord):
                    assert value.stype == "numpy.ndarray", (name, key)
                    assert value.data.startswith(b"\x93NUMPY"), (name, key)  # np.save
                    assert value.numpy().dtype != object  # loads with allow_pickle=False
                else:
                    assert not isinstance(value, bytes | list), (name, key)
    query_replies = [r for r in grid.replies if r.metadata.message_type == MessageType.QUERY]
    assert {tuple(r.content["statistics"].keys()) for r in query_replies} == \
        {("count", "sum", "outer")}


def test_a_node_answers_one_query_per_run(example):
    """A second query would be a second release of the node's data: refused."""
    grid = RecordingGrid(example.client, {}, NODES)
    node = next(iter(grid.contexts))
    model = example.new_model(example.digits(), 0)

    def query():
        msg = Message(RecordDict({"arrays": ArrayRecord(model.state_dict())}),
                      dst_node_id=node, message_type=MessageType.QUERY)
        (reply,) = grid.send_and_receive([msg])
        return reply

    assert not query().has_error()
    second = query()
    assert second.has_error() and "already released" in second.error.reason


def test_example_apps_are_flower_apps(example):
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    assert isinstance(example.server, ServerApp) and isinstance(example.client, ClientApp)
