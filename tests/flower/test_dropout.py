"""A lost node does not lose the round (flower.min-replies), and our deadline beats the Grid.

Each test makes one node fail at one phase of one exchange on a ``LoopbackGrid`` (the real
ServerApp and ClientApp code, messages serialised as through a SuperLink):

* ``before``: its ClientApp's handler raises on the message before doing anything (an error
  reply, which carries the error's code only: ``internal-error``);
* ``hang``: it never replies (a node stuck in training, or killed during it);
* ``upload``: its reply is lost mid-upload, and the Grid's pull of it *blocks* (Flower's
  Grid retries the objects of a reply whose upload stalled), holding back any reply pulled
  in the same call.

With at least ``flower.min-replies`` replies the round goes on with the others, the lost
client named in summary.json; with fewer, or without the CKKS key holder, the run stops
with one line naming the lost clients and nodes.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from loopback import NODE_BASE, LoopbackGrid  # noqa: E402

from privfedcal.flower.client_app import app as client_app  # noqa: E402
from privfedcal.flower.client_app import error_reply  # noqa: E402
from privfedcal.flower.link import FlowerRoundError, GridLink  # noqa: E402
from privfedcal.flower.records import FlowerOptions, record_to_state, to_run_config  # noqa: E402
from privfedcal.settings.floors import PrivacyOptions

TIMEOUT = 1.5  # flower.round-timeout of these tests: seconds
RUN_LIMIT = 120  # seconds a whole test run may take before it counts as hung


class FaultyGrid(LoopbackGrid):
    """A LoopbackGrid whose node of client ``victim`` fails at ``phase`` on the messages of
    type ``message`` (and group ``group``, if given); keeps the replies of ``train``."""

    def __init__(self, *args, victim: int, phase: str, message: str = "train",
                 group: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim, self.phase, self.message, self.group = victim, phase, message, group
        self.hits = 0
        self.stalled: set[str] = set()
        self.unblock = threading.Event()  # set at the end of a test: blocked pulls return
        self.trained: dict[tuple[int, str], dict] = {}  # (client, round) -> local state
        real = self.client_app

        def app(msg, context):
            if self._hit(msg) and phase == "before":  # answered as the ClientApp answers
                return error_reply(msg, RuntimeError("the node crashed before training"))
            reply = real(msg, context)
            if msg.metadata.message_type == "train" and not reply.has_error():
                self.trained[(context.node_id - NODE_BASE, msg.metadata.group_id)] = \
                    record_to_state(reply.content["local"])
            return reply

        self.client_app = app

    def _hit(self, msg) -> bool:
        return (msg.metadata.dst_node_id == NODE_BASE + self.victim
                and msg.metadata.message_type == self.message
                and self.group in (None, msg.metadata.group_id))

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            hit = self._hit(msg)
            (msg_id,) = super().push_messages([msg])
            self.hits += hit
            if hit and self.phase == "hang":
                self._replies.pop(msg_id)  # no reply will ever come
            if hit and self.phase == "upload":
                self.stalled.add(msg_id)
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids):
        message_ids = list(message_ids)
        if self.stalled & set(message_ids):
            self.unblock.wait()  # blocks like a pull of a half-uploaded reply
            return []
        return super().pull_messages(message_ids)


@pytest.fixture
def faulty_run(tmp_path):
    """Run ``cfg`` on a ``FaultyGrid`` through the real ServerApp; returns
    (simulator, summary, grid); blocked pulls are released afterwards."""
    from privfedcal.flower.server_app import run_server

    grids = []

    def run(cfg, min_replies=0, **fault):
        options = FlowerOptions(round_timeout=TIMEOUT, poll_interval=0.05, node_wait=2.0,
                                min_replies=min_replies)
        run_config = to_run_config(cfg.replace(out=str(tmp_path / "flower"), data_seed=None),
                                   options)
        grid = FaultyGrid(client_app, run_config, cfg.data.clients,
                          node_config={"data-seed": cfg.training.data_seed}, **fault)
        grids.append(grid)
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config=run_config)
        # in a thread: a ServerApp that waits on a blocked pull for ever fails the test
        # instead of hanging it
        out: dict = {}

        def serve():
            try:
                out["result"] = run_server(grid, ctx)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                out["error"] = exc

        worker = threading.Thread(target=serve, daemon=True)
        worker.start()
        worker.join(RUN_LIMIT)
        grid.unblock.set()
        assert not worker.is_alive(), f"the ServerApp still runs after {RUN_LIMIT} s"
        if "error" in out:
            raise out["error"]
        sim, summary = out["result"]
        return sim, summary, grid

    yield run
    for grid in grids:
        grid.unblock.set()


@pytest.mark.parametrize("phase", ["before", "hang", "upload"])
def test_round_goes_on_without_a_node_lost_in_training(flower_cfg, faulty_run, phase):
    cfg = flower_cfg(clients=3, rounds=2)
    t0 = time.monotonic()
    sim, summary, grid = faulty_run(cfg, min_replies=2, victim=2, phase=phase, group="2")
    assert grid.hits == 1 and summary["rounds"] == 2
    assert time.monotonic() - t0 < 60  # the stalled pull did not hold the ServerApp
    (drop,) = summary["dropped_clients"]
    assert (drop["client"], drop["node"], drop["message"], drop["group"]) == \
        (2, NODE_BASE + 2, "train", "2")
    want = {"before": "internal-error", "hang": "no reply within",
            "upload": "no reply within"}[phase]
    assert want in drop["reason"]
    assert any("round 2: client(s) [2] lost" in n for n in summary["notes"])
    # FedAvg: round 2's model is the sample-weighted average of clients 0 and 1 only
    sizes = sim.sizes
    w0, w1 = sizes[0] / (sizes[0] + sizes[1]), sizes[1] / (sizes[0] + sizes[1])
    for key, value in sim.global_state.items():
        if not value.is_floating_point():
            continue
        expected = w0 * grid.trained[(0, "2")][key] + w1 * grid.trained[(1, "2")][key]
        assert (value - expected).abs().max() < 1e-5, key


@pytest.mark.parametrize("phase", ["before", "hang", "upload"])
def test_too_few_replies_stop_the_run_naming_the_lost_node(flower_cfg, faulty_run, phase):
    cfg = flower_cfg(clients=3, rounds=2)
    t0 = time.monotonic()
    with pytest.raises(FlowerRoundError) as info:
        faulty_run(cfg, min_replies=3, victim=1, phase=phase, group="1")
    message = str(info.value)
    assert "\n" not in message
    assert "train round 1: 1 of 3 replies missing, 3 needed to go on" in message
    assert f"client 1 (node {NODE_BASE + 1}" in message
    assert time.monotonic() - t0 < 60


def test_default_needs_every_client(flower_cfg, faulty_run):
    with pytest.raises(FlowerRoundError, match=r"client 0 \(node 1000: internal-error\)"
                       ".*the node's log holds the error"):
        faulty_run(flower_cfg(clients=2, rounds=1), victim=0, phase="before")


def test_a_client_that_raises_is_dropped_with_its_code_only(flower_cfg, faulty_run,
                                                            monkeypatch, tmp_path):
    """Client 2's training raises an error whose text holds private numbers: the round goes
    on without it, and summary.json names it with the error's code, never the text."""
    from privfedcal.flower import client_app as module

    secret = "loss 3.14159 on client data n_k=417"
    real = module.train_client

    def train_client(*args):
        round_, client = args[-2:]
        if (round_, client) == (2, 2):
            raise FloatingPointError(secret)
        return real(*args)

    monkeypatch.setattr(module, "train_client", train_client)
    _, summary, _ = faulty_run(flower_cfg(clients=3, rounds=2), min_replies=2, victim=2,
                               phase="none")
    (drop,) = summary["dropped_clients"]
    assert (drop["client"], drop["message"], drop["group"], drop["reason"]) == \
        (2, "train", "2", "internal-error")
    written = (tmp_path / "flower" / "summary.json").read_text()
    assert '"reason": "internal-error"' in written
    assert "3.14159" not in written and "FloatingPointError" not in written


def test_blocking_pull_cannot_outlast_the_round_timeout(flower_cfg):
    """The Grid's pull blocks for ever on a half-uploaded reply: the exchange still ends at
    flower.round-timeout, and the reply that did arrive is not lost with it."""
    cfg = flower_cfg(clients=2)
    grid = FaultyGrid(client_app, to_run_config(cfg), 2, victim=1, phase="upload",
                      message="query.hello", group="x")
    link = GridLink(grid, 2, FlowerOptions(round_timeout=TIMEOUT, poll_interval=0.05))
    link.discover()  # group "hello": the nodes are mapped to their clients
    out: dict = {}

    def exchange():
        try:
            out["replies"] = link.exchange(RecordDict(), [0, 1], "query.hello", "x", need=1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    worker = threading.Thread(target=exchange, daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(30)
    grid.unblock.set()
    assert not worker.is_alive(), "the exchange blocked past its round timeout"
    assert time.monotonic() - t0 < TIMEOUT + 5
    assert "error" not in out, out.get("error")
    assert list(out["replies"]) == [0]
    assert [d["client"] for d in link.dropped] == [1]


def test_node_gone_from_the_superlink_is_lost_at_once(flower_cfg):
    cfg = flower_cfg(clients=3)
    grid = LoopbackGrid(client_app, to_run_config(cfg), 3)
    link = GridLink(grid, 3, FlowerOptions(round_timeout=600, poll_interval=0.05))
    link.discover()
    del grid.contexts[NODE_BASE + 2]  # the SuperLink no longer lists the node
    t0 = time.monotonic()
    replies = link.exchange(RecordDict(), [0, 1, 2], "query.hello", "y", need=2)
    assert sorted(replies) == [0, 1] and time.monotonic() - t0 < 5
    assert link.dropped[0]["reason"] == "no longer connected to the SuperLink"


# ---- secure aggregation ------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["hang", "upload"])
def test_secure_sum_goes_on_without_a_lost_uploaders_cohort(flower_cfg, faulty_run, phase):
    """A client lost before its ciphertext arrived is a planned upload missing from the sum,
    and it takes its cohort with it (privfedcal/privacy/cohorts.py): under Flower the key holder
    (client 0) is a client, so cohorts hold --secagg-min-clients 2 others besides it, 3
    clients: (0, 1, 2) and (3, 4, 5) at seed 0. Client 3 lost, the uploads of 4 and 5 are
    left out too, and the release is the sum of cohort (0, 1, 2). Never a sum of five that,
    set against the public totals, would single out client 3's."""
    pytest.importorskip("tenseal")
    from privfedcal.privacy.cohorts import cohort_plan

    cfg = flower_cfg(method="ccvr", secagg=True, clients=6, rounds=1)
    assert cohort_plan(PrivacyOptions.of(cfg.replace(secagg_key_holder=0))).cohorts == ((0, 1, 2), (3, 4, 5))
    sim, summary, grid = faulty_run(cfg, min_replies=5, victim=3, phase=phase,
                                    message="query.payload")
    assert grid.hits == 1
    assert [(d["client"], d["message"]) for d in summary["dropped_clients"]] == \
        [(3, "query.payload")]
    assert summary["skipped_releases"] == [] and summary["calibration"]
    assert [r["client"] for r in summary["rejected_uploads"]] == [4, 5]
    assert all("cohort" in r["reason"] for r in summary["rejected_uploads"])
    assert summary["privacy"]["whole_run"]["holds"] is True
    assert summary["privacy"]["whole_run"]["observer_knows"] == [0]
    aggregates = [e for e in sim.transcript.entries if e["view"] == "aggregate"]
    assert [e["clients"] for e in aggregates] == [3]


def test_secure_sum_keeps_the_secagg_minimum(flower_cfg, faulty_run):
    """flower.min-replies 1 does not lower --secagg-min-clients 3 (4 uploads: 3 besides the
    key holder's): with one of four uploaders lost the run stops rather than release a
    smaller sum."""
    pytest.importorskip("tenseal")
    cfg = flower_cfg(method="ccvr", secagg=True, clients=4, rounds=1, secagg_min_clients=3)
    with pytest.raises(FlowerRoundError, match="query.payload round ccvr-stats-1: 1 of 4 "
                       "replies missing, 4 needed to go on; lost: client 2"):
        faulty_run(cfg, min_replies=1, victim=2, phase="hang", message="query.payload")


@pytest.mark.parametrize("message", ["query.keygen", "query.decrypt"])
def test_lost_key_holder_stops_the_run(flower_cfg, faulty_run, message):
    pytest.importorskip("tenseal")
    cfg = flower_cfg(method="ccvr", secagg=True, clients=3, rounds=1)
    with pytest.raises(FlowerRoundError, match=r"the CKKS key holder \(client 0, "
                       "flower.key-holder\\) is lost, so release ccvr-stats-1 cannot be formed"):
        faulty_run(cfg, min_replies=2, victim=0, phase="hang", message=message)


def test_a_duplicate_pull_error_does_not_lose_a_reply(flower_cfg):
    """Flower's SuperLink deletes a message on its first pull and answers any later pull of
    it with an error reply ("Message Unavailable"). When a slow pull makes the exchange pull
    the outstanding replies one by one, a one-by-one pull may find a reply the slow pull
    already took: that error must not count as the client's answer (a real TLS run lost a
    client so before the fix)."""
    from flwr.app import Error, Message

    class Slow(LoopbackGrid):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sent, self.taken, self.errors = {}, set(), 0

        def push_messages(self, messages):
            messages = list(messages)
            ids = list(super().push_messages(messages))
            self.sent.update(zip(ids, messages, strict=True))
            return ids

        def pull_messages(self, message_ids):
            message_ids = list(message_ids)
            gone = [i for i in message_ids if i in self.taken]
            self.taken.update(message_ids)
            if not gone and len(message_ids) > 1:
                time.sleep(1.5)  # longer than the exchange's stall threshold (1 s here)
            self.errors += len(gone)
            return [Message(Error(0, "Message Unavailable"), reply_to=self.sent[i])
                    for i in gone] + list(super().pull_messages(message_ids))

    cfg = flower_cfg(clients=2)
    grid = Slow(client_app, to_run_config(cfg), 2)
    link = GridLink(grid, 2, FlowerOptions(round_timeout=3.0, poll_interval=0.05))
    link.discover()
    replies = link.exchange(RecordDict(), [0, 1], "query.hello", "x", need=1)
    assert grid.errors > 0  # the one-by-one pulls did find the replies gone
    assert sorted(replies) == [0, 1] and link.dropped == []


# ---- privacy accounting ------------------------------------------------------------------
@pytest.mark.parametrize("case", ["payload", "dp-sgd"])
def test_a_lost_client_is_charged_as_if_it_took_part(flower_cfg, faulty_run, case):
    """Client 2 is lost in a DP release (a calibration upload, or DP-SGD training in round
    2): its epsilon is the others', as if it had taken part (it may have computed and sent
    its share before it was lost)."""
    if case == "payload":
        cfg = flower_cfg(method="ccvr", dp_eps=8.0, clients=3, rounds=1)
        fault = {"message": "query.payload"}
    else:
        pytest.importorskip("opacus")
        cfg = flower_cfg(method="fedavg", dp_eps=8.0, dp_train=True, clients=3, rounds=2)
        fault = {"message": "train", "group": "2"}
    sim, summary, grid = faulty_run(cfg, min_replies=2, victim=2, phase="hang", **fault)
    assert grid.hits == 1 and [d["client"] for d in summary["dropped_clients"]] == [2]
    eps = summary["privacy"]["per_client_epsilon"]
    assert sorted(eps) == ["0", "1", "2"] and eps["2"] > 0
    assert eps["2"] == pytest.approx(eps["0"]) and eps["2"] == pytest.approx(eps["1"])
