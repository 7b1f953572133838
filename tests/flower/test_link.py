"""Failures under Flower are loud: missing nodes, failing clients, wrong node configs."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.app import RecordDict  # noqa: E402
from loopback import NODE_BASE, LoopbackGrid  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.client_app import app as client_app  # noqa: E402
from privfedcal.flower.link import FlowerRoundError, GridLink  # noqa: E402
from privfedcal.flower.records import FlowerOptions, to_run_config  # noqa: E402

FAST = FlowerOptions(round_timeout=0.5, poll_interval=0.05, node_wait=0.3)


def _link(cfg, nodes=None, grid_cls=LoopbackGrid):
    grid = grid_cls(client_app, to_run_config(cfg), nodes or cfg.data.clients)
    return grid, GridLink(grid, cfg.data.clients, FAST)


def test_discovery_maps_partitions_to_nodes(flower_cfg):
    grid, link = _link(flower_cfg(clients=3))
    link.discover()
    assert link.node_of == {k: NODE_BASE + k for k in range(3)}
    replies = link.exchange(RecordDict(), [2], "query.hello", "x")
    assert list(replies) == [2] and replies[2].metadata.src_node_id == NODE_BASE + 2


def test_too_few_nodes_times_out(flower_cfg):
    _, link = _link(flower_cfg(clients=3), nodes=2)
    with pytest.raises(FlowerRoundError, match="only 2 of 3 SuperNodes"):
        link.wait_for_nodes()


def test_duplicate_partition_ids_are_refused(flower_cfg):
    grid, link = _link(flower_cfg(clients=2))
    grid.contexts[NODE_BASE + 1].node_config["partition-id"] = 0
    with pytest.raises(UsageError, match="two SuperNodes claim partition-id 0"):
        link.discover()


def test_client_errors_fail_the_round_with_their_code(flower_cfg):
    grid, link = _link(flower_cfg(clients=2))
    grid.contexts[NODE_BASE + 1].node_config["num-partitions"] = 5
    with pytest.raises(FlowerRoundError, match=r"node 1001 \(bad-config\)") as info:
        link.discover()
    assert "num-partitions" not in str(info.value)  # the text stayed on the node


def test_the_server_keeps_a_code_never_the_text():
    """An error reply whose reason is not a declared code (the SuperNode's own, or a client
    that sends text) is kept as the name of Flower's error code."""
    from flwr.app import Error

    from privfedcal.flower.link import error_reason

    assert error_reason(Error(2, "budget-exhausted")) == "budget-exhausted"
    assert error_reason(Error(2, "<class 'KeyError'>:<'n_k=417'>")) == \
        "flower-client-app-raised-exception"
    assert error_reason(Error(8, "ClientApp stopped responding.")) == \
        "flower-client-app-crashed"
    assert error_reason(Error(99, "anything")) == "flower-error-99"


def test_missing_replies_time_out(flower_cfg):
    class Lossy(LoopbackGrid):
        def pull_messages(self, message_ids):
            return [m for m in super().pull_messages(message_ids)
                    if m.metadata.src_node_id != NODE_BASE]

    _, link = _link(flower_cfg(clients=2), grid_cls=Lossy)
    with pytest.raises(FlowerRoundError, match="1 of 2 replies missing"):
        link.discover()


def test_node_with_another_partition_config_is_caught(flower_cfg, run_flower):
    cfg = flower_cfg(rounds=1)
    grid = LoopbackGrid(client_app, to_run_config(cfg), 2)
    other = to_run_config(cfg.replace(alpha=5.0))  # another Dirichlet draw on this node
    grid.contexts[NODE_BASE + 1].run_config.update(other)
    with pytest.raises(FlowerRoundError, match="another dataset/partition config"):
        run_flower(cfg, grid=grid)


def test_oracle_and_bad_key_holder_are_refused(flower_cfg, run_flower):
    with pytest.raises(UsageError, match="oracle"):
        run_flower(flower_cfg(calibrate="oracle"))
    with pytest.raises(UsageError, match="key-holder[= ]3 is not a client"):
        cfg = flower_cfg(method="ccvr", secagg=True, clients=3, data_seed=None)
        from flwr.app import Context

        from privfedcal.flower.server_app import build_server

        run_config = {**to_run_config(cfg), "flower.key-holder": 3}
        build_server(LoopbackGrid(client_app, run_config, 3),
                     Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                             run_config=run_config))
