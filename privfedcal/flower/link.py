"""Server-side messaging over a Flower ``Grid``: clients (partition ids) <-> SuperNode ids.

Every exchange sends the same content to the SuperNodes of some clients and waits for their
replies (push, then pull every ``poll_interval`` seconds, up to ``round_timeout``). A client
whose node did not reply in time, replied with an error, or is no longer connected is
*lost*: the exchange returns the others' replies when at least ``need`` of them arrived
(the round goes on without the lost ones, which are recorded in ``dropped``), and otherwise
fails with the lost clients and their nodes named. ``need`` defaults to every client.

The deadline is ours, whatever the Grid does: each pull runs in a helper thread that the
exchange waits for at most until the deadline, so a pull that blocks (a reply whose upload
stalled half-way) cannot hold the ServerApp past ``round_timeout``.

With ``flower.hold`` > 0 every message is followed by a ``query.hold`` message to the same
node, pushed right after it (the SuperLink hands a node its messages one at a time, oldest
first). Flower 1.41's SuperNode pulls again as soon as it has pushed a reply and sleeps a
fixed 3 s when that pull finds nothing: the next message of a round usually comes a moment
later (after the other nodes' replies and the server's aggregation), so each round waited up
to 3 s. The hold's ClientApp only waits and sends an empty reply: long enough, the node's
next pull comes after the next message is there. A hold waits what the node is expected to
wait for its next message (from the nodes' measured times to answer and the server's own
time) less what a hold costs beyond its wait, plus ``flower.hold`` as a margin, at most 3 s
(``hold_seconds``). Holds are never waited for: their replies are pulled in the background
and once more at ``close``, and a node lost during a hold is noticed by the next real
exchange as before.

A client's error reply is kept as its code only (``error_reason``): a code of
``privacy/error_codes.py``, which is all privfedcal's ClientApp sends, or else the name of
Flower's error code; its text is never kept, logged or written to ``summary.json``.

Which node holds which partition is learnt from the replies (each carries ``meta``
{partition-id}); a ``query.hello`` round asks for it only when a round needs a subset of
clients before every node has answered once.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable
from typing import Any

from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode as FlowerErrorCode
from flwr.serverapp import Grid

from privfedcal.errors import PrivfedcalError, UsageError
from privfedcal.flower.records import FlowerOptions, as_int, record_at
from privfedcal.privacy.error_codes import CODES
from privfedcal.settings.descriptions import HOLD_CAP

#: the message type of a hold (``flower.hold``); its config carries ``seconds``
HOLD_MESSAGE = "query.hold"


class FlowerRoundError(PrivfedcalError, RuntimeError):
    """Clients did not answer an exchange, or answered with an error."""


#: Flower's error codes by value, as the server names them (``flower-client-app-crashed``)
_FLOWER_ERRORS = {v: "flower-" + k.lower().replace("_", "-")
                  for k, v in vars(FlowerErrorCode).items() if isinstance(v, int)}


def _log_note(reasons: Iterable[str]) -> str:
    """A pointer to the nodes' logs when some of ``reasons`` are error codes."""
    codes = set(CODES) | set(_FLOWER_ERRORS.values())
    if any(r in codes or r.startswith("flower-error-") for r in reasons):
        return " (an error reply carries only its code: the node's log holds the error)"
    return ""


def error_reason(error: Error) -> str:
    """What the server keeps of an error reply: its reason if that is one of the declared
    codes (``privacy/error_codes.py``), else the name of Flower's error code (the SuperNode's
    own replies, or a client that sent text): never the text it received."""
    reason = str(error.reason)
    if reason in CODES:
        return reason
    return _FLOWER_ERRORS.get(error.code, f"flower-error-{int(error.code)}")


def _harvest(pulls: list[_Pull | None], ids: set[str], errors: dict[str, Message],
             got: list[Message], arrived: dict[str, float] | None) -> None:
    """Take the replies of every finished pull not yet harvested: a good reply of an
    outstanding message settles it (into ``got``, its time into ``arrived``), an error
    reply waits in ``errors`` until no other pull of that message is running."""
    for pull in pulls:
        if pull is None or not pull.done() or pull.harvested:
            continue
        pull.harvested = True
        for reply in pull.result():
            msg_id = reply.metadata.reply_to_message_id
            if msg_id not in ids:
                continue
            if reply.has_error():
                errors.setdefault(msg_id, reply)
                continue
            ids.discard(msg_id)
            errors.pop(msg_id, None)
            got.append(reply)
            if arrived is not None:
                arrived[msg_id] = time.monotonic()


class GridLink:
    """Sends one content to a set of clients and returns their replies by client index."""

    def __init__(self, grid: Grid, num_clients: int, options: FlowerOptions) -> None:
        self.grid = grid
        self.num_clients = num_clients
        self.options = options
        self.node_of: dict[int, int] = {}   # partition id -> SuperNode id
        self.exchanges = 0
        self.dropped: list[dict[str, Any]] = []  # lost clients of exchanges that went on
        self.holds: list[dict[str, Any]] = []    # every hold sent: {node, seconds, group}
        # flower.hold bookkeeping (monotonic seconds, the ServerApp's own polls)
        self._service: dict[int, list[float]] = {}  # node -> its last 3 times to answer
        self._server_time = 0.0                  # last reply -> next push, last exchange
        self._last_reply: float | None = None    # when the last exchange's last reply came
        self._last_hold: dict[int, str] = {}     # node -> id of its latest hold
        self._hold_ids: set[str] = set()         # holds whose replies were not pulled yet
        self._hold_node: dict[str, int] = {}     # hold message id -> its node
        self._hold_len: dict[str, float] = {}    # hold message id -> its seconds
        self._hold_back: dict[str, float] = {}   # hold message id -> when its reply came
                                                 # (cleared at each push)
        self._overhead: dict[int, float] = {}    # node -> a hold's time beyond its seconds
        self._hold_pull: _Pull | None = None
        # holds whose reply came before their node's next message was pushed: the node then
        # pulled an empty queue and slept Flower's 3 s (a lower bound: a reply seen after
        # the push may have been sent before it)
        self.missed_holds = 0

    def wait_for_nodes(self) -> list[int]:
        """Block until ``num_clients`` SuperNodes are connected (or ``node_wait`` passes)."""
        deadline = time.monotonic() + self.options.node_wait
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.num_clients:
                return nodes
            if time.monotonic() > deadline:
                raise FlowerRoundError(f"only {len(nodes)} of {self.num_clients} SuperNodes "
                                       f"connected within {self.options.node_wait:g} s")
            time.sleep(self.options.poll_interval)

    def discover(self) -> dict[int, Message]:
        """Ask every node for its partition id (``query.hello``); its replies by client."""
        nodes = self.wait_for_nodes()
        replies, lost = self._send(RecordDict(), "query.hello", nodes, group="hello")
        if lost:  # every node must answer once: its client's size and data settings
            raise FlowerRoundError(
                f"query.hello round hello: {len(lost)} of {len(nodes)} replies missing; lost: "
                + "; ".join(f"node {n} ({why})" for n, why in sorted(lost.items()))
                + _log_note(lost.values()))
        return replies

    def exchange(self, content: RecordDict, clients: Iterable[int], message_type: str,
                 group: str, need: int | None = None) -> dict[int, Message]:
        """Send ``content`` to the nodes of ``clients``; replies keyed by client index.

        ``need``: fewest replies the exchange may go on with (None: all). Lost clients are
        appended to ``dropped``; with fewer than ``need`` replies it raises
        ``FlowerRoundError`` naming them."""
        wanted = sorted(set(clients))
        need = len(wanted) if need is None else min(max(need, 1), len(wanted))
        if any(c not in self.node_of for c in wanted):
            if len(wanted) == self.num_clients:
                nodes = self.wait_for_nodes()        # everyone: map from the replies
            else:
                self.discover()
                nodes = [self.node_of[c] for c in wanted]
        else:
            nodes = [self.node_of[c] for c in wanted]
        replies, lost = self._send(content, message_type, nodes, group)
        client_of = {n: c for c, n in self.node_of.items()}
        lost_clients = {client_of[n]: (n, why) for n, why in lost.items() if n in client_of}
        unmapped = {n: why for n, why in lost.items() if n not in client_of}
        missing = [c for c in wanted if c not in replies]
        if len(replies) < need or unmapped:
            named = [f"client {c} (node {lost_clients[c][0]}: {lost_clients[c][1]})"
                     for c in missing if c in lost_clients]
            named += [f"node {n} ({why})" for n, why in sorted(unmapped.items())]
            raise FlowerRoundError(
                f"{message_type} round {group}: {len(wanted) - len(replies)} of "
                f"{len(wanted)} replies missing, {need} needed to go on; lost: "
                + "; ".join(named) + _log_note(lost.values()))
        for c in missing:
            node, why = lost_clients[c]
            self.dropped.append({"group": group, "message": message_type, "client": c,
                                 "node": node, "reason": why})
        return {c: replies[c] for c in wanted if c in replies}

    def _send(self, content: RecordDict, message_type: str, nodes: list[int],
              group: str) -> tuple[dict[int, Message], dict[int, str]]:
        """Replies by client, and the lost nodes with why (no reply, an error, gone)."""
        connected = set(self.grid.get_node_ids())
        lost = {n: "no longer connected to the SuperLink" for n in nodes if n not in connected}
        live = [n for n in nodes if n in connected]
        messages = [Message(content, dst_node_id=n, message_type=message_type, group_id=group)
                    for n in live]
        self._drain_holds()  # hold replies already pulled: those nodes are not holding
        pushed_at = time.monotonic()
        if self._last_reply is not None:
            self._server_time = pushed_at - self._last_reply
        # holds still running now: their nodes start on this message when they end
        running = {n: self._last_hold[n] for n in live
                   if self._last_hold.get(n) in self._hold_ids}
        self.missed_holds += sum(self._last_hold.get(n) in self._hold_back for n in live)
        self._hold_back.clear()
        pushed = list(self.grid.push_messages(messages)) if messages else []
        node_of_msg = dict(zip(pushed, live, strict=True))
        holds = self._push_holds(live, group) if self.options.hold > 0 and live else []
        ids = set(pushed)
        self.exchanges += 1
        deadline = time.monotonic() + self.options.round_timeout
        arrived: dict[str, float] = {}
        got = self._collect(ids, deadline, arrived)
        replied = {node_of_msg[m]: at for m, at in arrived.items()}
        if replied:
            self._last_reply = max(replied.values())
        if holds:
            self._time_holds(holds, live, replied, pushed_at, running)
        for msg_id in ids:
            lost[node_of_msg[msg_id]] = (f"no reply within {self.options.round_timeout:g} s "
                                         "(flower.round-timeout)")
        replies, errors = self._by_client(got, node_of_msg)
        lost.update(errors)
        return replies, lost

    def hold_seconds(self, node: int, nodes: list[int]) -> float:
        """How long ``node``'s hold waits when a message goes to ``nodes`` now.

        The hold must last from the node's reply to the next push, which comes when the
        slowest node has replied and the server has aggregated: expected, the slowest
        node's time to answer less this node's, plus the server's time (each node's time to
        answer is the median of its last three, counted from when it could start: the push,
        or the end of the hold it was still running then, so that a hold's own lateness
        does not feed back into the others' holds). The node pulls again after the hold's
        wait plus what a hold costs beyond it (a ClientApp process and Flower's polls,
        ``_overhead``, measured on its earlier holds), so that cost is taken off, and
        ``flower.hold`` is added as a margin (a node that pulls just before its message
        comes sleeps 3 s); at least ``flower.hold``, at most ``HOLD_CAP``."""
        answer = {n: statistics.median(self._service[n]) for n in nodes if n in self._service}
        margin = self.options.hold
        if node not in answer:
            return margin
        expected = max(answer.values()) - answer[node] + self._server_time
        return min(HOLD_CAP, max(margin, expected - self._overhead.get(node, 0.0) + margin))

    def _push_holds(self, nodes: list[int], group: str) -> list[str]:
        """One hold message per node, queued behind the message just pushed to it; their
        ids (``_send`` has taken the hold replies already pulled)."""
        seconds = {n: round(self.hold_seconds(n, nodes), 3) for n in nodes}
        holds = [Message(RecordDict({"config": ConfigRecord({"seconds": seconds[n]})}),
                         dst_node_id=n, message_type=HOLD_MESSAGE, group_id=group)
                 for n in nodes]
        ids = list(self.grid.push_messages(holds))
        self._hold_ids.update(ids)
        self._hold_node.update(zip(ids, nodes, strict=True))  # until its reply is pulled
        self._hold_len.update((i, seconds[n]) for i, n in zip(ids, nodes, strict=True))
        self._last_hold.update(zip(nodes, ids, strict=True))
        self.holds += [{"node": n, "seconds": seconds[n], "group": group} for n in nodes]
        return ids

    def _time_holds(self, holds: list[str], nodes: list[int], replied: dict[int, float],
                    pushed_at: float, running: dict[int, str]) -> None:
        """After an exchange: each node's time to answer (from the push, or from the end of
        the hold it was running then), and a hold's cost beyond its wait for the holds whose
        replies came while the exchange still pulled (timed by the same polls as the node's
        reply)."""
        for node, at in replied.items():
            if node in running:  # started on this message when that hold ended
                if running[node] not in self._hold_back:
                    continue  # its end was not seen: no time for this exchange
                start = max(pushed_at, self._hold_back[running[node]])
            else:
                start = pushed_at
            self._service[node] = [*self._service.get(node, []), at - start][-3:]
        for hold, node in zip(holds, nodes, strict=True):
            back, seconds = self._hold_back.get(hold), self._hold_len.pop(hold)
            if back is not None and node in replied and back > replied[node]:
                self._overhead[node] = max(0.0, back - replied[node] - seconds)

    def _drain_holds(self) -> None:
        """Take the hold replies a background pull brought and start the next pull (one at a
        time; a hold's reply carries nothing, so a failed pull is only retried)."""
        pull = self._hold_pull
        if pull is not None and pull.done():
            self._hold_pull = None
            if not pull.failed():
                for reply in pull.result():
                    hold = reply.metadata.reply_to_message_id
                    if hold in self._hold_ids:
                        self._hold_ids.discard(hold)
                        self._hold_node.pop(hold, None)
                        self._hold_back[hold] = pull.finished
        if self._hold_pull is None and self._hold_ids:
            self._hold_pull = _Pull(self.grid, sorted(self._hold_ids))

    def close(self, timeout: float = HOLD_CAP + 10.0) -> None:
        """Pull the replies of the holds still out (each at most ``HOLD_CAP`` seconds
        after the node's last reply) from the nodes still connected, for at most ``timeout``
        seconds, so that no message of the run is left on the SuperLink."""
        end = time.monotonic() + timeout
        if self._hold_ids:  # a node that left will not answer its hold
            connected = set(self.grid.get_node_ids())
            self._hold_ids = {i for i in self._hold_ids if self._hold_node[i] in connected}
        while self._hold_ids and time.monotonic() < end:
            self._drain_holds()
            if self._hold_pull is not None:
                _Pull.wait_any([self._hold_pull], min(self.options.poll_interval,
                                                      end - time.monotonic()))

    def _collect(self, ids: set[str], deadline: float,
                 arrived: dict[str, float] | None = None) -> list[Message]:
        """Pull the replies of ``ids`` until all came or ``deadline`` passed; what did not
        come stays in ``ids``.

        Pulls run in helper threads (``_Pull``) and are waited for at most until the
        deadline. One pull asks for every outstanding reply; if it has not returned after
        ``stall`` seconds (Flower's Grid retries the objects of a reply whose upload
        stalled), each outstanding reply is then also pulled on its own, so a stalled one
        does not hold back the replies that are there. Two pulls of one reply may then run
        at once, and the later finds it gone (Flower answers with an error reply, "Message
        Unavailable"): an error reply settles a message only when no other pull of it is
        still running. A pull left running at the deadline is a daemon thread. ``arrived``
        receives the time each good reply was taken.
        """
        poll = self.options.poll_interval
        stall = min(max(5.0, 5 * poll), self.options.round_timeout / 3)
        got: list[Message] = []
        errors: dict[str, Message] = {}   # error replies not yet final
        batch: _Pull | None = None
        single: dict[str, _Pull] = {}
        one_by_one = False
        next_pull = time.monotonic()

        def running(msg_id: str) -> bool:
            return any(p is not None and not p.done() and msg_id in p.ids
                       for p in [batch, *single.values()])

        while True:
            _harvest([batch, *single.values()], ids, errors, got, arrived)
            batch = batch if batch is not None and not batch.done() else None
            single = {i: p for i, p in single.items() if not p.done() and i in ids}
            now = time.monotonic()
            for msg_id in [i for i in errors if i in ids]:
                if not running(msg_id) or now >= deadline:
                    ids.discard(msg_id)  # no pull of it left that could bring the reply
                    got.append(errors.pop(msg_id))
            if not ids or now >= deadline:
                return got
            if batch is not None and now - batch.started > stall:
                one_by_one = True
            if now >= next_pull:  # at most one pull of a reply per poll interval
                self._drain_holds()  # flower.hold: time the holds' replies as they come
                if one_by_one:
                    for msg_id in ids - set(single) - set(errors):
                        single[msg_id] = _Pull(self.grid, [msg_id])
                elif batch is None:
                    batch = _Pull(self.grid, sorted(ids))
                next_pull = now + poll
            live = [p for p in [batch, *single.values()] if p is not None]
            _Pull.wait_any(live, min(next_pull, deadline) - now)

    def _by_client(self, replies: list[Message], node_of_msg: dict[str, int]
                   ) -> tuple[dict[int, Message], dict[int, str]]:
        out: dict[int, Message] = {}
        errors: dict[int, str] = {}
        for reply in replies:
            # the node we sent to: an error made by the SuperLink or the Grid on the node's
            # behalf (a lost upload) names another source
            node = node_of_msg.get(reply.metadata.reply_to_message_id,
                                   reply.metadata.src_node_id)
            if reply.has_error():
                errors[node] = error_reason(reply.error)
                continue
            client = as_int(record_at(reply.content, "meta", ConfigRecord)["partition-id"])
            if client in out or self.node_of.get(client, node) != node:
                raise UsageError(f"two SuperNodes claim partition-id {client}: give every "
                                 f"node its own --node-config partition-id")
            if not 0 <= client < self.num_clients:
                raise UsageError(f"node {node} has partition-id {client}, outside "
                                 f"0..{self.num_clients - 1}")
            self.node_of[client] = node
            out[client] = reply
        return out, errors


class _Pull:
    """One ``grid.pull_messages`` call in a daemon thread (a Grid's pull can block)."""

    def __init__(self, grid: Grid, ids: list[str]) -> None:
        self.ids = ids
        self.started = time.monotonic()
        self.harvested = False  # its replies were taken by the exchange
        self.finished = 0.0     # when the pull returned
        self._box: dict[str, Any] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(grid,), daemon=True,
                                        name="privfedcal-pull")
        self._thread.start()

    def _run(self, grid: Grid) -> None:
        try:
            self._box["replies"] = list(grid.pull_messages(self.ids))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self._box["error"] = exc
        finally:
            self.finished = time.monotonic()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        return "error" in self._box

    def result(self) -> list[Message]:
        if "error" in self._box:
            raise self._box["error"]
        return self._box["replies"]

    @staticmethod
    def wait_any(pulls: list[_Pull], timeout: float) -> None:
        """Return when one of ``pulls`` is done or ``timeout`` seconds passed."""
        end = time.monotonic() + max(0.0, timeout)
        while not any(p.done() for p in pulls):
            left = end - time.monotonic()
            if left <= 0:
                return
            if pulls:
                pulls[0]._done.wait(min(left, 0.02))
            else:
                time.sleep(left)
