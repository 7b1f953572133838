"""Server-side messaging over a Flower ``Grid``: clients (partition ids) <-> SuperNode ids.

Every exchange sends the same content to the SuperNodes of some clients and waits for all
replies (push, then pull every ``poll_interval`` seconds, up to ``round_timeout``): a missing
or failed reply fails the round with the clients named, never silently shrinks it.

Which node holds which partition is learnt from the replies (each carries ``meta``
{partition-id}); a ``query.hello`` round asks for it only when a round needs a subset of
clients before every node has answered once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from privfedcal.errors import UsageError
from privfedcal.flower.records import FlowerOptions


class FlowerRoundError(RuntimeError):
    """Clients did not answer an exchange, or answered with an error."""


class GridLink:
    """Sends one content to a set of clients and returns their replies by client index."""

    def __init__(self, grid: Grid, num_clients: int, options: FlowerOptions) -> None:
        self.grid = grid
        self.num_clients = num_clients
        self.options = options
        self.node_of: dict[int, int] = {}   # partition id -> SuperNode id
        self.exchanges = 0

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
        return self._send(RecordDict(), "query.hello", self.wait_for_nodes(), group="hello")

    def exchange(self, content: RecordDict, clients: Iterable[int], message_type: str,
                 group: str) -> dict[int, Message]:
        """Send ``content`` to the nodes of ``clients``; replies keyed by client index."""
        wanted = sorted(set(clients))
        if any(c not in self.node_of for c in wanted):
            if len(wanted) == self.num_clients:
                nodes = self.wait_for_nodes()        # everyone: map from the replies
            else:
                self.discover()
                nodes = [self.node_of[c] for c in wanted]
        else:
            nodes = [self.node_of[c] for c in wanted]
        replies = self._send(content, message_type, nodes, group)
        missing = sorted(set(wanted) - set(replies))
        if missing:
            raise FlowerRoundError(f"{message_type} round {group}: no reply for client(s) "
                                   f"{missing}")
        return {c: replies[c] for c in wanted}

    def _send(self, content: RecordDict, message_type: str, nodes: list[int],
              group: str) -> dict[int, Message]:
        messages = [Message(content, dst_node_id=n, message_type=message_type, group_id=group)
                    for n in nodes]
        ids = set(self.grid.push_messages(messages))
        self.exchanges += 1
        deadline = time.monotonic() + self.options.round_timeout
        got: list[Message] = []
        while ids:
            for reply in self.grid.pull_messages(ids):
                ids.discard(reply.metadata.reply_to_message_id)
                got.append(reply)
            if not ids:
                break
            if time.monotonic() > deadline:
                raise FlowerRoundError(f"{message_type} round {group}: {len(ids)} of "
                                       f"{len(nodes)} replies missing after "
                                       f"{self.options.round_timeout:g} s")
            time.sleep(self.options.poll_interval)
        return self._by_client(got, message_type, group)

    def _by_client(self, replies: list[Message], message_type: str,
                   group: str) -> dict[int, Message]:
        out: dict[int, Message] = {}
        errors = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                errors.append(f"node {node}: {reply.error.reason}")
                continue
            client = int(reply.content["meta"]["partition-id"])
            if client in out or self.node_of.get(client, node) != node:
                raise UsageError(f"two SuperNodes claim partition-id {client}: give every "
                                 f"node its own --node-config partition-id")
            if not 0 <= client < self.num_clients:
                raise UsageError(f"node {node} has partition-id {client}, outside "
                                 f"0..{self.num_clients - 1}")
            self.node_of[client] = node
            out[client] = reply
        if errors:
            raise FlowerRoundError(f"{message_type} round {group} failed on the clients: "
                                   + "; ".join(errors))
        return out
