"""``flower.hold``: a ``query.hold`` message follows every message to a node, so that the
node's next pull comes after the next message is there (flower/link.py).

Over a ``LoopbackGrid`` (the real ServerApp and ClientApp, every message serialised): each
message to a node is followed by exactly one hold to the same node, pushed after it; holds
last the node's previous wait, clipped to [flower.hold, 3 s]; every hold's reply is pulled by
the end of the run; the run's numbers are those of a run without holds. The ClientApp's
hold refuses a length outside [0, 3] s. The real-process speed-up is measured by
``benchmarks/flower/flower_overhead.py --modes deployment-warm,deployment-warm-hold``.
"""

from __future__ import annotations

import time
from uuid import uuid4

import pytest

pytest.importorskip("flwr")

from flwr.app import Message, RecordDict  # noqa: E402
from loopback import LoopbackGrid  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.settings.descriptions import HOLD_CAP  # noqa: E402


class OrderGrid(LoopbackGrid):
    """A loopback grid that records (node, message type, hold seconds) of every push in
    order, and holds back a node's replies (other than holds') for ``slow`` seconds after
    their push."""

    def __init__(self, *args, slow: dict[int, float] | None = None, answer_holds: bool = False,
                 hold_cost: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answer_holds, self.hold_cost = answer_holds, hold_cost
        self.last_ready: dict[int, float] = {}
        self.pushed: list[tuple[int, str, float | None]] = []
        self.slow = slow or {}
        self.ready_at: dict[str, float] = {}
        self.timeline: list[tuple[int, str, str, float]] = []  # (node, type, id, pushed at)

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            config = m.content.config_records.get("config")
            seconds = config.get("seconds") if m.metadata.message_type == "query.hold" else None
            self.pushed.append((m.metadata.dst_node_id, m.metadata.message_type, seconds))
        if self.answer_holds:
            ids = [self._answer_hold(m) if m.metadata.message_type == "query.hold"
                   else self._push_one(m) for m in messages]
        else:
            ids = [self._push_one(m) for m in messages]
        now = time.monotonic()
        self.timeline += [(m.metadata.dst_node_id, m.metadata.message_type, i, now)
                          for m, i in zip(messages, ids, strict=True)]
        return ids

    def missed(self) -> int:
        """Holds that ended before their node's next message was pushed (in Flower the node
        then pulls an empty queue and sleeps 3 s)."""
        count, hold_end = 0, {}
        for node, kind, msg_id, at in self.timeline:
            if kind == "query.hold":
                hold_end[node] = self.ready_at[msg_id]
            elif node in hold_end:
                count += hold_end.pop(node) < at
        return count

    def _push_one(self, m):
        (msg_id,) = super().push_messages([m])
        if m.metadata.message_type != "query.hold":
            self.ready_at[msg_id] = (time.monotonic()
                                     + self.slow.get(m.metadata.dst_node_id, 0.0))
            self.last_ready[m.metadata.dst_node_id] = self.ready_at[msg_id]
        return msg_id

    def _answer_hold(self, m):
        """The hold's reply, without running the ClientApp (the loopback runs it inside
        push_messages, where a hold's wait would delay the server itself): available
        ``hold_cost`` + its seconds after the node's last reply."""
        m.metadata.__dict__["_message_id"] = msg_id = uuid4().hex
        m.metadata.__dict__["_run_id"] = self.run_id
        self._replies[msg_id] = Message(RecordDict(), reply_to=m)
        node = m.metadata.dst_node_id
        seconds = m.content.config_records["config"]["seconds"]
        self.ready_at[msg_id] = (self.last_ready.get(node, 0.0) + self.hold_cost + seconds
                                 if self.hold_cost else 0.0)
        return msg_id

    def pull_messages(self, message_ids):
        now = time.monotonic()
        return super().pull_messages([i for i in message_ids
                                      if self.ready_at.get(i, 0.0) <= now])


@pytest.fixture
def run_with_hold(tmp_path):
    """Run ``cfg`` through run_server with ``flower.hold`` set in the server's run config."""
    from flwr.app import Context, RecordDict

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.flower.server_app import run_server

    def run(cfg, hold, slow=None, answer_holds=False, hold_cost=0.0):
        run_config = to_run_config(cfg.replace(out=str(tmp_path / f"hold-{hold}"),
                                               data_seed=None), FlowerOptions(hold=hold))
        grid = OrderGrid(client_app, run_config, cfg.data.clients, slow=slow,
                         answer_holds=answer_holds, hold_cost=hold_cost,
                         node_config={"data-seed": cfg.training.data_seed})
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config=run_config)
        sim, summary = run_server(grid, ctx)
        return sim, summary, grid

    return run


def test_every_message_is_followed_by_one_hold_to_its_node(flower_cfg, run_with_hold):
    cfg = flower_cfg(rounds=2, clients=2, method="ccvr")
    _, summary, grid = run_with_hold(cfg, hold=0.02)
    for node in grid.contexts:
        kinds = [kind for n, kind, _ in grid.pushed if n == node]
        real = [k for k in kinds if k != "query.hold"]
        assert {"train", "query.payload"} <= set(real)
        # real message, its hold, real message, its hold, ...
        assert kinds == [k for r in real for k in (r, "query.hold")], kinds
    seconds = [s for _, kind, s in grid.pushed if kind == "query.hold"]
    assert all(0.02 <= s <= HOLD_CAP for s in seconds)
    assert summary["flower_holds"]["sent"] == len(seconds)
    assert grid._replies == {}, "hold replies left on the grid"


def test_holds_change_no_number(flower_cfg, run_with_hold):
    cfg = flower_cfg(rounds=2, clients=2, method="ccvr")
    sim0, plain, grid0 = run_with_hold(cfg, hold=0.0)
    sim1, held, _ = run_with_hold(cfg, hold=0.01)
    assert not [kind for _, kind, _ in grid0.pushed if kind == "query.hold"]
    assert "flower_holds" not in plain and held["flower_holds"]["sent"] > 0
    assert held["accuracy"] == plain["accuracy"]
    for key, value in sim0.global_state.items():
        assert sim1.global_state[key].equal(value), key


def test_a_hold_lasts_the_nodes_previous_wait(flower_cfg, run_with_hold):
    """Node 1 replies 0.3 s after node 0 in every exchange, so node 0 waits that much longer
    for the next message: after the first exchange its holds are longer by about that."""
    cfg = flower_cfg(rounds=2, clients=2, method="fedavg")
    _, _, grid = run_with_hold(cfg, hold=0.01, slow={1001: 0.3}, answer_holds=True)
    holds = {n: [s for m, kind, s in grid.pushed if m == n and kind == "query.hold"]
             for n in grid.contexts}
    assert holds[1000][0] == holds[1001][0] == 0.01  # no previous wait known
    # node 0's wait: node 1's 0.3 s more, plus the server's own time, which node 1 waits too
    extra = [a - b for a, b in zip(holds[1000][1:], holds[1001][1:], strict=True)]
    assert all(0.25 <= e <= 1.0 for e in extra), holds


def test_missed_holds_are_counted(flower_cfg, run_with_hold):
    """A hold that ends before its node's next message comes is counted in the summary
    (``flower_holds.missed``, a lower bound: only replies pulled before the push count): with
    node 1 always 1 s slower and holds of 0.05 s at first, some are missed, and the count
    never exceeds the misses that happened."""
    cfg = flower_cfg(rounds=2, clients=2, method="fedavg")
    _, summary, grid = run_with_hold(cfg, hold=0.05, slow={1001: 1.0}, answer_holds=True,
                                     hold_cost=0.05)
    assert 0 < summary["flower_holds"]["missed"] <= grid.missed(), grid.missed()


def test_hold_seconds_rule():
    """The slowest node's time to answer less this node's, plus the server's time, less the
    hold's measured cost, plus flower.hold as a margin; within [flower.hold, HOLD_CAP]."""
    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions

    link = GridLink(grid=None, num_clients=2, options=FlowerOptions(hold=0.5))  # type: ignore[arg-type]
    assert link.hold_seconds(7, [7, 8]) == 0.5                # nothing known: the margin
    link._service, link._server_time = {7: [1.0], 8: [1.8]}, 0.3
    assert link.hold_seconds(7, [7, 8]) == pytest.approx(1.6)  # 1.8 - 1.0 + 0.3 + 0.5
    assert link.hold_seconds(8, [7, 8]) == pytest.approx(0.8)  # the slowest: server time
    assert link.hold_seconds(7, [7]) == pytest.approx(0.8)     # only the nodes of this push
    link._overhead[7] = 0.4                                     # a hold costs 0.4 s more
    assert link.hold_seconds(7, [7, 8]) == pytest.approx(1.2)
    link._overhead[7] = 5.0
    assert link.hold_seconds(7, [7, 8]) == 0.5                # never below the margin
    link._overhead.clear()
    link._service[8] = [1.8, 9.0, 2.2]                          # the median of the last three
    assert link.hold_seconds(7, [7, 8]) == pytest.approx(2.0)
    link._service[8] = [9.0, 9.0, 9.0]
    assert link.hold_seconds(7, [7, 8]) == HOLD_CAP           # capped at Flower's idle sleep


def test_a_nodes_time_to_answer_leaves_out_its_holds_lateness():
    """A node still holding when its message came starts when its hold ends: its lateness
    is not its time to answer (else the other nodes' holds would follow it)."""
    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions

    link = GridLink(grid=None, num_clients=3, options=FlowerOptions(hold=0.1))  # type: ignore[arg-type]
    link._hold_back = {"h7": 102.0}
    link._time_holds([], [], {7: 102.5, 8: 100.7, 9: 101.0}, pushed_at=100.0,
                     running={7: "h7", 9: "h9"})
    assert link._service == {7: [pytest.approx(0.5)], 8: [pytest.approx(0.7)]}  # 9: unknown


def test_a_holds_cost_is_measured(flower_cfg, run_with_hold):
    """Each hold's reply comes 0.6 s after its wait: the link learns that cost per node."""
    cfg = flower_cfg(rounds=3, clients=2, method="fedavg")
    sim, _, grid = run_with_hold(cfg, hold=0.01, slow={1001: 1.5}, answer_holds=True,
                                 hold_cost=0.6)
    overhead = sim.link._overhead
    assert 1000 in overhead, overhead  # node 0 replies first: its hold comes back in time
    assert 0.4 <= overhead[1000] <= 1.0, overhead


@pytest.mark.parametrize("bad", [-1.0, HOLD_CAP + 0.5, True, "1"])
def test_flower_hold_setting_is_checked(bad):
    from privfedcal.flower.records import FlowerOptions

    with pytest.raises(UsageError, match="flower.hold"):
        FlowerOptions(hold=bad)


@pytest.mark.parametrize("seconds, ok", [(0.05, True), (-0.1, False), (HOLD_CAP + 1, False)])
def test_client_hold_waits_then_replies_empty(seconds, ok):
    from flwr.app import ConfigRecord

    from privfedcal.flower.client_app import app as client_app

    grid = LoopbackGrid(client_app, {}, 1)
    msg = Message(RecordDict({"config": ConfigRecord({"seconds": seconds})}), dst_node_id=1000,
                  message_type="query.hold", group_id="1")
    t0 = time.monotonic()
    (reply,) = grid.send_and_receive([msg])
    took = time.monotonic() - t0
    if ok:
        assert not reply.has_error()
        assert len(reply.content) == 0 and took >= seconds
    else:
        assert reply.has_error() and reply.error.reason == "bad-config"


def test_close_does_not_wait_for_a_node_that_left(flower_cfg):
    """A hold out to a node that is gone is not waited for at the end of the run."""
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions

    class Gone(LoopbackGrid):
        def get_node_ids(self):
            return []

    link = GridLink(Gone(client_app, {}, 1), 1, FlowerOptions(hold=0.2))
    link._hold_ids, link._hold_node = {"m"}, {"m": 1000}
    t0 = time.monotonic()
    link.close(timeout=5.0)
    assert time.monotonic() - t0 < 1.0 and link._hold_ids == set()


def test_the_server_retries_object_pulls_quickly(flower_cfg, run_with_hold, monkeypatch):
    """The ServerApp sets Flower's first retry of a reply's missing objects to 0.05 s
    (flower/pulls.py): a reply is often found while its model is still uploading."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    from privfedcal.flower.pulls import PULL_INITIAL_BACKOFF

    fn = iu.pull_objects
    monkeypatch.setattr(fn, "__kwdefaults__", {**fn.__kwdefaults__, "initial_backoff": 1})
    run_with_hold(flower_cfg(rounds=1, clients=2, method="fedavg"), hold=0.0)
    assert fn.__kwdefaults__["initial_backoff"] == PULL_INITIAL_BACKOFF
