"""An in-process Flower ``Grid``: run a ServerApp against a ClientApp in one Python process,
with no SuperLink, for testing and debugging one's own Flower app (docs/flower.md).

The real ServerApp and ClientApp code runs; every message is serialised to Flower's wire
objects and inflated again on the other side (as through a SuperLink, so nothing can share
Python objects across the boundary); each node keeps its own ``Context`` (node config,
``context.state``) across messages; an exception that escapes the ClientApp becomes the
error reply a deployment's ``flwr-clientapp`` makes of it (its class and text). Not a
deployment: no processes, no network, no isolation between the nodes' Python state, and
delivery is synchronous (no timeouts, no lost nodes).

    grid = InProcessGrid(client_app, {"num-server-rounds": 2}, num_nodes=3)
    context = grid.run_server_app(server_app)   # the ServerApp's Context after its main returned

    context = run_app("path/to/app", num_nodes=3, overrides={"num-server-rounds": 2})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import flatten_dict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.object_ref import load_app
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from privfedcal.errors import UsageError

__all__ = ["NODE_BASE", "InProcessGrid", "app_run_config", "over_the_wire", "run_app"]

NODE_BASE = 1000  # node ids of the in-process SuperNodes (1 is the SuperLink's)


def over_the_wire(msg: Message) -> tuple[Message, int]:
    """``msg`` deflated to bytes and inflated again (Flower's object serialisation), and
    the number of bytes it took."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    size = sum(len(c) for c in contents.values())
    out = inflate_object_from_contents(msg.object_id, contents)
    assert isinstance(out, Message)
    return out, size


class InProcessGrid(Grid):
    """``num_nodes`` nodes, ids ``NODE_BASE + k``, each with node config ``partition-id = k``,
    ``num-partitions = num_nodes`` (as Flower's simulation gives) and the entries of
    ``node_config`` (every node's), and ``run_config`` as every node's run config.

    Creating one sets Flower's process-wide ``TaskIdentity`` to a ServerApp task of
    ``run_id`` (the SuperLink runtime does this for a real ServerApp process).
    ``bytes_sent`` and ``bytes_received`` count the serialised messages and replies.
    """

    def __init__(self, client_app: ClientApp, run_config: Mapping[str, Any] | None = None,
                 num_nodes: int = 2, run_id: int = 1,
                 node_config: Mapping[str, Any] | None = None) -> None:
        if not isinstance(client_app, ClientApp):
            raise UsageError(f"client_app must be a flwr ClientApp, got "
                             f"{type(client_app).__name__}")
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise UsageError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 1, 0
        self.client_app = client_app
        self.run_id = run_id
        self.run_config = dict(run_config or {})
        self.contexts = {
            NODE_BASE + k: Context(run_id=run_id, node_id=NODE_BASE + k,
                                   node_config={"partition-id": k, "num-partitions": num_nodes,
                                                **(node_config or {})},
                                   state=RecordDict(), run_config=dict(self.run_config))
            for k in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    def run_server_app(self, server_app: ServerApp) -> Context:
        """Run ``server_app`` (its ``@app.main()`` function) over this grid with a server
        ``Context`` holding the run config; returns that Context once the ServerApp
        returned (what its main kept in ``context.state`` is there)."""
        if not isinstance(server_app, ServerApp):
            raise UsageError(f"server_app must be a flwr ServerApp, got "
                             f"{type(server_app).__name__}")
        context = Context(run_id=self.run_id, node_id=1, node_config={}, state=RecordDict(),
                          run_config=dict(self.run_config))
        server_app(self, context)
        return context

    # ---- Grid API -----------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        # an empty Run of this grid's id unless one was set (Flower's compatibility
        # layer reads ``grid.run.run_id``)
        if getattr(self, "_run", None) is None:
            self._run = Run.create_empty(self.run_id)
        return self._run

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


def _app_table(app_dir: Path) -> dict[str, Any]:
    import tomllib

    path = Path(app_dir) / "pyproject.toml"
    if not path.is_file():
        raise UsageError(f"{app_dir} is not a Flower app: it has no pyproject.toml")
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as ex:
        raise UsageError(f"{path} is not valid TOML: {ex}") from None
    app = doc.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, dict):
        raise UsageError(f"{path} has no [tool.flwr.app] table: not a Flower app")
    return app


def app_run_config(app_dir: str | Path, overrides: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The app's run config: its ``[tool.flwr.app.config]`` flattened to dotted keys
    (``a.b``), with ``overrides`` in place of declared keys. A key the app does not
    declare is refused (as ``flwr run --run-config`` refuses it)."""
    declared = flatten_dict(_app_table(Path(app_dir)).get("config", {}))
    unknown = sorted(set(overrides or {}) - set(declared))
    if unknown:
        raise UsageError(f"{app_dir} declares no run-config key {', '.join(unknown)} "
                         f"(declared: {', '.join(sorted(declared)) or 'none'})")
    return {**declared, **(overrides or {})}


def run_app(app_dir: str | Path, num_nodes: int, overrides: Mapping[str, Any] | None = None,
            *, node_config: Mapping[str, Any] | None = None) -> Context:
    """Load the ServerApp and ClientApp a Flower app folder names
    (``[tool.flwr.app.components]``, the folder first on ``sys.path``, as Flower does), run
    them over an ``InProcessGrid`` of ``num_nodes`` nodes with the app's run config and
    ``overrides``, and return the ServerApp's Context."""
    app_dir = Path(app_dir).resolve()
    components = _app_table(app_dir).get("components", {})
    refs = {k: components.get(k) for k in ("serverapp", "clientapp")}
    missing = [k for k, v in refs.items() if not isinstance(v, str)]
    if missing:
        raise UsageError(f"{app_dir}/pyproject.toml names no {' and '.join(missing)} in "
                         "[tool.flwr.app.components]")
    run_config = app_run_config(app_dir, overrides)
    server = load_app(refs["serverapp"], UsageError, app_dir)
    client = load_app(refs["clientapp"], UsageError, app_dir)
    grid = InProcessGrid(client, run_config, num_nodes, node_config=node_config)
    return grid.run_server_app(server)
