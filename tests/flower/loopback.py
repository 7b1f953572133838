"""A Flower ``Grid`` that delivers messages to ClientApps in this process (no SuperLink).

Test code, not part of the package: for tests/flower/ (pytest puts this folder on sys.path)
and ``benchmarks/flower_overhead.py`` (which adds it). The real ServerApp and ClientApp code
runs, every message is serialised to Flower's wire objects and inflated again on the other side (as
through a SuperLink, so nothing can share Python objects across the boundary), each node
keeps its own ``Context`` (node config, ``context.state``) across messages, and an exception
that escapes the ClientApp becomes the error reply a deployment's ``flwr-clientapp`` makes of
it (its class and text; privfedcal's own ClientApp lets none escape). Not a deployment: no processes,
no network, no isolation between the nodes' Python state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

NODE_BASE = 1000  # node ids of the loopback SuperNodes (1 is the SuperLink's)


def over_the_wire(msg: Message) -> tuple[Message, int]:
    """``msg`` deflated to bytes and inflated again (Flower's object serialisation), and
    the number of bytes it took."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    size = sum(len(c) for c in contents.values())
    out = inflate_object_from_contents(msg.object_id, contents)
    assert isinstance(out, Message)
    return out, size


class LoopbackGrid(Grid):
    """Nodes ``NODE_BASE + k`` with node config ``partition-id = k``, ``num-partitions = K``
    and the entries of ``node_config`` (every node's: e.g. the secret ``data-seed``).

    Creating one sets Flower's process-wide ``TaskIdentity`` to a ServerApp task of
    ``run_id`` (the SuperLink runtime does this for a real ServerApp process).
    """

    def __init__(self, client_app: ClientApp, run_config: Mapping[str, Any], num_nodes: int,
                 run_id: int = 1, node_config: Mapping[str, Any] | None = None) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 1, 0
        self.client_app = client_app
        self.run_id = run_id
        self.contexts = {
            NODE_BASE + k: Context(run_id=run_id, node_id=NODE_BASE + k,
                           node_config={"partition-id": k, "num-partitions": num_nodes,
                                        **(node_config or {})},
                           state=RecordDict(), run_config=dict(run_config))
            for k in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    # ---- Grid API -----------------------------------------------------------------------
    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return getattr(self, "_run", None)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            msg.metadata.__dict__["_run_id"] = self.run_id
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                raise ValueError(f"no node {node}")
            received, size = over_the_wire(msg)
            received.metadata.__dict__["_message_id"] = msg.metadata.message_id
            self.bytes_sent += size
            try:
                reply = self.client_app(received, self.contexts[node])
            except Exception as ex:  # noqa: BLE001 - a deployment turns it into an error reply
                # flwr 1.41 supernode/runtime/run_clientapp.py: the class and the text
                reason = str(type(ex)) + ":<'" + str(ex) + "'>"
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason),
                                reply_to=received)
            back, size = over_the_wire(reply)
            self.bytes_received += size
            self._replies[msg.metadata.message_id] = back
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        # delivery is synchronous: every reply exists once push_messages returns
        return list(self.pull_messages(list(self.push_messages(messages))))
