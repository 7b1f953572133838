"""The privfedcal ClientApp: one SuperNode is one client of the in-process simulator.

The node's partition comes from its node config (``partition-id``, ``num-partitions``, and
``data-seed``: the seed of the partition, which every node of a run shares and the server
never sees; ``node_data_seed``); the client rebuilds the experiment from the run config with
``experiment.build_experiment`` (same seed, same partition, same model and method objects as the
simulator) and trains with the simulator's ``train_client``, so a client computes bit for
bit what the simulator computes for it.

Messages (content keys; replies carry ``meta`` = {partition-id} and ``metrics``):

* ``train``: ``global`` (ArrayRecord), ``config`` {round} -> ``local`` (ArrayRecord),
  metrics {num-examples, train-loss} (no train-loss under --dp-train or --dp-updates;
  under --dp-updates ``local`` is the global state moved by the node's clipped update,
  ``sent_update``: the update stages' client halves). The method's
  per-client state (MOON's previous model) stays on the node, in
  ``context.state["privfedcal.client-state"]``.
* ``evaluate``: ``global`` -> metrics {num-examples, loss, accuracy} on the local data;
  privfedcal's ServerApp never sends it, and a client refuses it under any DP setting.
* ``query.payload``: ``state``, ``task``/``task-arrays`` (``flower/tasks.py``), ``config``
  {round, label}, ``secagg`` (with secure aggregation) -> ``payload``
  (ArrayRecord of the task's sums, DP-noised) or ``ciphertext`` {data: bytes}; the client
  side of the uplink runs here (``flower/stage_messages.py``).
* Under DP, ``query.payload`` and (with --dp-train) ``train`` are releases: the node counts
  them in its own ledger, in ``context.state["privfedcal.ledger"]``, and refuses one past
  the count its noise was planned for (``flower/node_ledger.py``; ``BudgetRefused``).
* ``query.keygen`` / ``query.decrypt``: the key holder's role (client ``flower.key-holder``).
* ``query.hello``: -> meta {partition-id, num-partitions, settings (a digest of the data
  settings, ``partition_settings_digest``)}, metrics {num-examples}.
* ``query.hold``: ``config`` {seconds} -> an empty reply after waiting that long
  (``flower.hold``; ``flower/link.py`` says why); it builds nothing and reads no data.

A message the node cannot answer gets an error reply whose reason is a code of
``privacy/error_codes.py`` and nothing else (``CodedClientApp``): the error's text stays in
the node's own log. Left to Flower, an exception raised in a ClientApp crosses the wire as
its class and text (flwr 1.41, ``supernode/runtime/run_clientapp.py``), and an error's text
can hold anything the failing code had at hand.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode as FlowerErrorCode

from privfedcal.errors import UsageError
from privfedcal.experiment import build_experiment
from privfedcal.federation.local import evaluate, train_client
from privfedcal.federation.setup import (
    Experiment,
    partition_is_secret,
    partition_settings_digest,
)
from privfedcal.flower.node_ledger import node_release
from privfedcal.flower.records import (
    as_int,
    parse_run_config,
    record_at,
    record_to_state,
    state_to_record,
)
from privfedcal.flower.stage_messages import SECAGG, client_upload, decrypt, keygen
from privfedcal.flower.tasks import TASK_ARRAYS, TASK_CONFIG, task_from_records
from privfedcal.privacy.error_codes import ErrorCode, Refused, error_code
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.update_stage import UpdateRound
from privfedcal.settings.descriptions import HOLD_CAP
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.settings.run_config import RunConfig

CLIENT_STATE = "privfedcal.client-state"
#: set (to anything but "" or "0") in a SuperNode's environment: each message's handler
#: prints one line of timings on stderr (benchmarks/flower/flower_overhead.py reads them)
TIMING_ENV = "PRIVFEDCAL_CLIENTAPP_TIMING"
_BUILD_SECONDS: list[float] = []  # experiment builds in this process (client_runtime)


def _timing_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """A Flower mod around every handler: with ``TIMING_ENV`` set, one stderr line
    ``privfedcal-clientapp timing: <type> handler S s, experiment build B s``."""
    if os.environ.get(TIMING_ENV, "") in ("", "0"):
        return call_next(msg, context)
    start, builds = time.perf_counter(), len(_BUILD_SECONDS)
    try:
        return call_next(msg, context)
    finally:
        build = sum(_BUILD_SECONDS[builds:])
        print(f"privfedcal-clientapp timing: {msg.metadata.message_type} handler "
              f"{time.perf_counter() - start:.3f} s, experiment build {build:.3f} s",
              file=sys.stderr, flush=True)


#: the node's own log: a failed message's full error (never sent)
LOG = logging.getLogger("privfedcal.flower.client")


def error_reply(msg: Message, exc: BaseException) -> Message:
    """The reply to ``msg``, whose handler raised ``exc``: Flower's error with a code of
    ``privacy/error_codes.py`` as its whole reason; the error itself goes to the node's log."""
    code = error_code(exc)
    LOG.error("%s message failed; the server is sent only the code %s",
              msg.metadata.message_type, code.value, exc_info=exc)
    return _coded(msg, code)


def _coded(msg: Message, code: ErrorCode) -> Message:
    return Message(Error(code=FlowerErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=code.value),
                   reply_to=msg)


class CodedClientApp(ClientApp):
    """A ClientApp that never lets an exception reach Flower: every one, raised by a handler,
    a mod or Flower's dispatch, becomes ``error_reply``. (``BaseException``s that are not
    ``Exception``s end the process; the SuperNode then answers with its fixed text.)"""

    def __call__(self, message: Message, context: Context) -> Message:
        category, _, action = message.metadata.message_type.partition(".")
        # Flower's dispatch raises ValueError for a type without a handler: say so by code
        # (its registry is private; test_wire_fields.py sends such a message)
        if f"{category}.{action or 'default'}" not in self._registered_funcs:
            LOG.error("no handler for message type %r; the server is sent only the code %s",
                      message.metadata.message_type, ErrorCode.UNKNOWN_MESSAGE.value)
            return _coded(message, ErrorCode.UNKNOWN_MESSAGE)
        try:
            return super().__call__(message, context)
        except Exception as exc:  # noqa: BLE001 - answered with its code only
            return error_reply(message, exc)


app = CodedClientApp(mods=[_timing_mod])

# One ClientApp process may serve several messages (simulation engine, tests): keep the
# experiment of the last run config instead of rebuilding the data for every message.
_EXPERIMENTS: dict[str, tuple[Experiment, Any]] = {}


@dataclass
class ClientRuntime:
    """What one client needs: its config, experiment, uplink and partition."""

    cfg: RunConfig
    exp: Experiment
    uplink: Any
    partition: int

    @property
    def idx(self) -> torch.Tensor:
        """This node's training indices (a client's experiment holds its partition)."""
        if self.exp.parts is None:
            raise RuntimeError("the node's experiment holds no partition")
        return self.exp.parts[self.partition]

    def meta(self) -> ConfigRecord:
        return ConfigRecord({"partition-id": self.partition})


def node_partition(context: Context, num_clients: int) -> int:
    """The node's ``partition-id``, checked against ``num-partitions`` and the run config."""
    nc = context.node_config
    if "partition-id" not in nc:
        raise UsageError("this SuperNode has no partition-id: start it with --node-config "
                         "'partition-id=K num-partitions=N'")
    k = int(nc["partition-id"])
    n = int(nc.get("num-partitions", num_clients))
    if n != num_clients:
        raise UsageError(f"node num-partitions={n} differs from the run's clients={num_clients}")
    if not 0 <= k < num_clients:
        raise UsageError(f"node partition-id={k} is outside 0..{num_clients - 1}")
    return k


#: where a node finds the data seed when its node config has none: the environment of the
#: SuperNode (or, on the simulation engine, whose virtual nodes' configs Flower writes, of
#: the SuperLink that runs them)
DATA_SEED_ENV = "PRIVFEDCAL_DATA_SEED"


def node_data_seed(context: Context, cfg: RunConfig) -> RunConfig:
    """``cfg`` with the node's data seed: its node config's ``data-seed``, else the
    environment's ``PRIVFEDCAL_DATA_SEED``, else the run config's (which the ServerApp
    refuses on a protected run: the server reads the run config). Under a protection
    (``partition_is_secret``) one of them must give it: every node must draw the same
    partition, from a seed the server does not hold."""
    for where, raw in (("node config data-seed", context.node_config.get("data-seed", "")),
                       (DATA_SEED_ENV, os.environ.get(DATA_SEED_ENV, ""))):
        if raw not in ("", None):
            try:
                return cfg.replace(data_seed=int(raw))
            except (TypeError, ValueError):
                raise UsageError(f"{where}={raw!r} is not an integer") from None
    if cfg.training.data_seed is None and partition_is_secret(PrivacyOptions.of(cfg)):
        raise UsageError("this run's protections need a partition the server cannot redraw: "
                         "give every SuperNode the same secret --node-config 'data-seed=S' "
                         f"(or {DATA_SEED_ENV}=S in its environment; docs/flower.md)")
    return cfg


def node_threads(context: Context, cfg: RunConfig) -> int:
    """Torch threads of this node's ClientApp: the node config's ``threads``, else the run
    config's, else 1. Several SuperNodes often share a machine (a local deployment, a
    simulation): each taking every core oversubscribes it, so the default is one thread;
    a node alone on its machine is given more with ``--node-config "... threads=N"``."""
    raw = context.node_config.get("threads", "")
    if raw not in ("", None):
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = 0
        if value < 1:
            raise UsageError(f"node config threads={raw!r} must be an integer >= 1")
        return value
    return cfg.engine.threads or 1


def client_runtime(context: Context) -> ClientRuntime:
    """The node's experiment and uplink, built as the simulator builds them.

    The protection plan is computed here too, from the node's own run config: the DP noise
    and, with ``--dp-train``, the local training's DP-SGD schedule, exactly as on the
    simulator's side.
    """
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.executor import execute_plan, training_spec
    from privfedcal.privacy.planner import plan_for_run

    cfg, _ = parse_run_config(context.run_config)
    # a node trains its one client: no worker pool, no batch of clients
    cfg = node_data_seed(context, cfg.replace(workers=1, client_batch=1))
    torch.set_num_threads(node_threads(context, cfg))
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if key not in _EXPERIMENTS:
        _EXPERIMENTS.clear()
        start = time.perf_counter()
        exp = build_experiment(cfg)
        plan = plan_for_run(exp.privacy, calibrator_class(cfg), exp.num_examples)  # resolved
        exp.spec = training_spec(exp.spec, plan)
        uplink = execute_plan(plan)
        _EXPERIMENTS[key] = (exp, uplink)
        _BUILD_SECONDS.append(time.perf_counter() - start)
    exp, uplink = _EXPERIMENTS[key]
    return ClientRuntime(cfg, exp, uplink, node_partition(context, cfg.data.clients))


def _reported_size(rt: ClientRuntime) -> int:
    """The client's size as it tells the server: 0 under --dp-train and --hide-counts, where
    sizes are private data and aggregation weights are uniform (privacy/uplink_updates.py
    ``update_weights``; Flower runs have no --secagg-updates)."""
    return 0 if rt.cfg.privacy.dp_train or rt.cfg.privacy.hide_counts else int(rt.idx.numel())


def _reply(msg: Message, rt: ClientRuntime, **records: Any) -> Message:
    content = RecordDict({"meta": rt.meta(), **records})
    return Message(content, reply_to=msg)


def sent_update(uplink: Any, global_state: dict[str, torch.Tensor],
                state: dict[str, torch.Tensor], round_: int,
                client: int) -> dict[str, torch.Tensor]:
    """The node's trained ``state`` as it leaves the node: the uplink's update stages'
    client halves (``--dp-updates``: clipped to the plan's clip, privacy/update_stage.py)."""
    # the node records no transcript (the server records its own view): an empty one
    rnd = UpdateRound(None, [], global_state, [client], [], round_, Transcript(None),
                      client=client)
    return uplink.update_client(state, rnd)


@app.train()
def train(msg: Message, context: Context) -> Message:
    rt = client_runtime(context)
    exp = rt.exp
    round_ = as_int(record_at(msg.content, "config", ConfigRecord)["round"])
    global_state = record_to_state(record_at(msg.content, "global", ArrayRecord), exp.device)
    kept = context.state.array_records.get(CLIENT_STATE)
    client_state = record_to_state(kept, exp.device) if kept is not None else None
    # under --dp-train local training is a release: the node's own ledger (node_ledger.py)
    released = rt.cfg.privacy.dp_train
    with node_release(context, rt.uplink, DPSGD_RELEASE) if released else nullcontext():
        state, new_client_state, loss = train_client(
            exp.model, exp.algo, global_state, client_state, exp.data.x_train,
            exp.data.y_train, rt.idx, exp.spec, round_, rt.partition)
    if new_client_state is not None:
        context.state[CLIENT_STATE] = state_to_record(new_client_state)
    state = sent_update(rt.uplink, global_state, state, round_, rt.partition)
    if rt.uplink.hides_loss:  # e.g. --dp-updates: the loss is private, it stays here
        loss = None
    values: dict[str, int | float | list[int] | list[float]] = {
        "num-examples": _reported_size(rt)}
    if loss is not None:  # None under DP: the loss is private and stays on the node
        values["train-loss"] = float(loss)
    return _reply(msg, rt, local=state_to_record(state), metrics=MetricRecord(values))


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    rt = client_runtime(context)
    if rt.cfg.privacy.dp_enabled or rt.cfg.privacy.dp_train or rt.cfg.privacy.dp_updates:
        # the local loss and accuracy are functions of the client's data outside any budget
        raise Refused("local evaluation is refused under DP: its loss and accuracy on the "
                         "client's data would leave the client uncharged")
    exp = rt.exp
    state = record_to_state(record_at(msg.content, "global", ArrayRecord), exp.device)
    ev = evaluate(exp.model, state, exp.data.x_train[rt.idx], exp.data.y_train[rt.idx],
                  exp.data.num_classes)
    metrics = MetricRecord({"num-examples": _reported_size(rt), "loss": float(ev["loss"]),
                            "accuracy": float(ev["accuracy"])})
    return _reply(msg, rt, metrics=metrics)


@app.query("payload")
def payload(msg: Message, context: Context) -> Message:
    rt = client_runtime(context)
    exp = rt.exp
    content = msg.content
    config = record_at(content, "config", ConfigRecord)
    label = str(config["label"])
    # refused before anything is computed past the node's planned count (node_ledger.py)
    with node_release(context, rt.uplink, label):
        task = task_from_records(record_at(content, TASK_CONFIG, ConfigRecord),
                                 record_at(content, TASK_ARRAYS, ArrayRecord), exp.device)
        model = exp.model
        model.load_state_dict(record_to_state(record_at(content, "state", ArrayRecord),
                                              exp.device))
        model.eval()
        x, y = exp.data.x_train[rt.idx], exp.data.y_train[rt.idx]
        upload = task.compute(model, x, y, rt.uplink.bound)  # bound: inside the task
        records = client_upload(rt.uplink, upload, label=label, round_=as_int(config["round"]),
                                client=rt.partition, secagg=content.config_records.get(SECAGG))
    return _reply(msg, rt, **records)


def _key_holder(context: Context) -> ClientRuntime:
    """This node, if the run config names it the key holder (``flower.key-holder``)."""
    rt = client_runtime(context)
    _, options = parse_run_config(context.run_config)
    if not (rt.cfg.privacy.secagg and rt.partition == options.key_holder):
        raise UsageError(f"client {rt.partition} is not this run's CKKS key holder")
    return rt


@app.query("keygen")
def keygen_query(msg: Message, context: Context) -> Message:
    rt = _key_holder(context)
    return _reply(msg, rt, **dict(keygen(context, record_at(msg.content, "config", ConfigRecord))))


@app.query("decrypt")
def decrypt_query(msg: Message, context: Context) -> Message:
    rt = _key_holder(context)
    config = record_at(msg.content, "config", ConfigRecord)
    return _reply(msg, rt, **dict(decrypt(context, config, rt.uplink)))


@app.query("hold")
def hold(msg: Message, context: Context) -> Message:
    seconds = msg.content["config"]["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not 0 <= seconds <= HOLD_CAP:
        raise UsageError(f"query.hold: seconds must be in [0, {HOLD_CAP:g}], got {seconds!r}")
    time.sleep(seconds)
    return Message(RecordDict(), reply_to=msg)


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    rt = client_runtime(context)
    meta = ConfigRecord({"partition-id": rt.partition, "num-partitions": rt.cfg.data.clients,
                         "settings": partition_settings_digest(rt.exp.data_options)})
    return Message(RecordDict({"meta": meta, "metrics": MetricRecord(
        {"num-examples": _reported_size(rt)})}), reply_to=msg)


__all__ = ["CodedClientApp", "app", "client_runtime", "error_reply", "node_partition"]
