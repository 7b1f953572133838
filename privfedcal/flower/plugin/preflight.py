"""Everything the plugin can check, checked before the user's first FedAvg round.

    preflight(grid, model, context, head="fc3", test_data=testloader())   # one line, then
    result = strategy.start(grid=grid, ...)

On the server: ``calibrate``'s arguments, the model's head, the test data's first batch,
the settings (keywords and the run config's ``privfedcal.*`` keys), the run folder, and
the protection's plan for the nodes there are (secure aggregation's cohorts and key
holder). On every node, through one ``query.preflight`` message (``check_node``): its
partition id, its settings (and that they are the server's: the ``query.hello`` digest),
its model and head, and one batch of its data (keys, types, labels, that the model takes
it and predicts with the head). The first failure is one line (``PreflightError``) naming
the node, the reason and the fix, in the plugin's words (``wording.py``). A node answers
with a code of ``preflight_codes.py``, never an error's text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import nn
from torch.utils.data import DataLoader

from privfedcal.errors import UsageError
from privfedcal.flower.link import GridLink, error_reason
from privfedcal.flower.plugin import data as node_data
from privfedcal.flower.plugin.plugin_settings import KEYS, PluginSettings, resolve
from privfedcal.flower.plugin.preflight_codes import FIX, PreflightCode
from privfedcal.flower.plugin.wording import boundary, threads_setting, torch_threads
from privfedcal.models.head_adapter import HeadAdapter

#: a ``client.CalibrationClient`` (not imported: the client imports this module)
CalibrationClient = Any

__all__ = ["PreflightError", "check_node", "preflight"]

log = logging.getLogger("privfedcal.flower")
#: the record of a ``query.preflight`` reply
RECORD = "preflight"
Outcome = tuple[PreflightCode, str]


class PreflightError(UsageError):
    """A check before training failed: one line naming the node, the reason and the fix."""


# ---- a node's side -----------------------------------------------------------------------
#: settings under which another one is valid on its own (a clip belongs to a DP budget,
#: hidden counts to secure aggregation)
_ENABLING = {"dp-eps": 1.0, "secagg": True}


def _refused(flat: Mapping[str, Any], clients: int | None) -> bool:
    try:
        resolve(flat, clients=clients)
    except UsageError:
        return True
    return False


def _bad_setting(flat: Mapping[str, Any], clients: int | None) -> str:
    """The first of the node's settings (a name of ``KEYS``) that ``resolve`` refuses on
    its own, with and without DP and secure aggregation on, or "" when only their
    combination fails. Only the node's public configuration is read."""
    kept = {k: flat[k] for k in ("method", "clients") if k in flat}
    for key in sorted(k for k in flat if k in KEYS and k not in kept):
        enabled = {k: v for k, v in _ENABLING.items() if k != key}
        if all(_refused({**kept, **base, key: flat[key]}, clients) for base in ({}, enabled)):
            return key
    return ""


def _settings(client: CalibrationClient, context: Context) -> Outcome | PluginSettings:
    from privfedcal.flower.plugin.plugin_settings import gather

    nc = context.node_config
    parts = nc.get("num-partitions")
    clients = None if parts is None else int(parts)
    try:
        flat = gather(client.keywords, context.run_config, nc)
    except UsageError:
        return PreflightCode.UNKNOWN_SETTING, ""
    try:
        settings, _ = client.node_settings(context)
        _plan(settings, client.size(context) if settings.examples is None else 0)
    except UsageError:
        return PreflightCode.BAD_SETTING, _bad_setting(flat, clients)
    return settings


def _adapter(client: CalibrationClient, context: Context) -> Outcome | HeadAdapter:
    try:
        model = client.build_model(context)
    except Exception:  # noqa: BLE001 - the user's builder: reported by its check's code
        log.exception("preflight: the model could not be built")
        return PreflightCode.BAD_MODEL, ""
    if not isinstance(model, nn.Module):
        return PreflightCode.BAD_MODEL, ""
    try:
        adapter = HeadAdapter(model, client.head, client.num_classes)
    except UsageError:
        log.exception("preflight: the model's head")
        return PreflightCode.BAD_HEAD, ""
    adapter.to(client.device)
    if client._adapter is None:
        client._adapter = adapter
    return adapter


def _first_batch(client: CalibrationClient, context: Context) -> Outcome | Any:
    """The first raw batch of the node's data, or the code of what stops it."""
    try:
        data = client.data(context)
        loader = data if isinstance(data, DataLoader) else DataLoader(
            data, batch_size=client.batch_size, shuffle=False)
        return next(iter(loader))
    except StopIteration:
        return PreflightCode.EMPTY_DATA, ""
    except Exception:  # noqa: BLE001 - the user's data: reported by its check's code
        log.exception("preflight: the node's data could not be read")
        return PreflightCode.BAD_DATA, ""


def _keys_missing(batch: Mapping[str, Any], keys: tuple[str, str] | None) -> bool:
    if keys is not None:
        return any(k not in batch for k in keys)
    return not (any(k in batch for k in node_data.X_KEYS)
                and any(k in batch for k in node_data.Y_KEYS))


def _check_batch(client: CalibrationClient, adapter: HeadAdapter, batch: Any) -> Outcome:
    if isinstance(batch, Mapping) and _keys_missing(batch, client.batch_keys):
        return PreflightCode.BATCH_KEYS, ""
    try:
        x, y = node_data.split_batch(batch, client.batch_keys)
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= adapter.num_classes):
            return PreflightCode.BAD_BATCH, ""
        x = x.to(client.device)
    except UsageError:
        return PreflightCode.BAD_BATCH, ""
    try:
        adapter.net.eval()
        adapter.net(x)
    except Exception:  # noqa: BLE001 - the user's model on the user's data
        log.exception("preflight: the model's forward on a batch of the node's data")
        return PreflightCode.DATA_DOES_NOT_FIT, ""
    try:
        adapter.check(x)
        adapter.features(x)
    except UsageError:
        return PreflightCode.HEAD_NOT_OUTPUT, ""
    return PreflightCode.OK, ""


def check_node(client: CalibrationClient, context: Context) -> tuple[Outcome, str, int]:
    """The node's preflight: its outcome (code, setting name), its settings' digest ("" if
    they do not resolve) and its sample count (0 unless every check passed)."""
    if "partition-id" not in context.node_config:
        return (PreflightCode.NO_PARTITION, ""), "", 0
    adapter = _adapter(client, context)
    if isinstance(adapter, tuple):
        return adapter, "", 0
    batch = _first_batch(client, context)
    if isinstance(batch, tuple) and batch and isinstance(batch[0], PreflightCode):
        return batch, "", 0
    outcome = _check_batch(client, adapter, batch)
    if outcome[0] is not PreflightCode.OK:
        return outcome, "", 0
    settings = _settings(client, context)
    if isinstance(settings, tuple):
        return settings, "", 0
    return (PreflightCode.OK, ""), settings.digest(), client.size(context)


def reply(client: CalibrationClient, msg: Message, context: Context) -> Message:
    """``query.preflight``'s reply: the partition id, the outcome and, when it passed, the
    settings' digest and the sample count (as ``query.hello``'s)."""
    try:
        (code, key), digest, n = check_node(client, context)
    except Exception:  # noqa: BLE001 - any other failure: its code, the error in the log
        log.exception("preflight failed on this node")
        (code, key), digest, n = (PreflightCode.INTERNAL, ""), "", 0
    if code is not PreflightCode.OK:
        log.error("privfedcal preflight: %s", _text(code, key))
    partition = int(context.node_config.get("partition-id", -1))
    return Message(RecordDict({
        "meta": ConfigRecord({"partition-id": partition, "settings": digest}),
        RECORD: ConfigRecord({"check": code.value, "key": key}),
        "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)


# ---- the server's side -------------------------------------------------------------------
def _text(code: PreflightCode, key: str) -> str:
    name = key or "(one of them)"
    return FIX[code].format(key=f"privfedcal.{name}" if key else name,
                            keyword=key.replace("-", "_").removeprefix("flower.") or "...")


def _plan(settings: PluginSettings, examples: int) -> None:
    """The protection's plan for these settings (the planner's checks: cohorts, the key
    holder, budgets), as the server and each node make it at calibration."""
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.planner import plan_for_run
    from privfedcal.settings.floors import PrivacyOptions

    cfg = settings.cfg
    preset = None
    if settings.auto_clip is not None:  # any clip: the search chooses it later
        cfg, preset = cfg.replace(dp_clip=1.0), settings.auto_clip.preset()
    plan_for_run(PrivacyOptions.of(cfg), calibrator_class(cfg),
                 settings.examples or max(examples, 1), preset)


def _node_problem(node: int, reply: Message | None, want: str) -> str | None:
    """What is wrong with ``node``'s preflight reply, as the server says it, or None."""
    if reply is None:
        return (f"node {node} did not answer privfedcal's preflight: attach "
                "CalibrationClient(...) to its ClientApp")
    if reply.has_error():
        return (f"node {node} could not answer privfedcal's preflight "
                f"({error_reason(reply.error)}, its code only): attach CalibrationClient(...) to its "
                "ClientApp (the node's log holds the error)")
    record = reply.content.config_records.get(RECORD)
    if record is None:
        return f"node {node} answered privfedcal's preflight with no outcome"
    try:
        code = PreflightCode(str(record["check"]))
    except (KeyError, ValueError):
        return f"node {node} answered privfedcal's preflight with no outcome"
    partition = int(str(reply.content["meta"].get("partition-id", -1)))
    where = f"node {node}" + (f" (partition-id {partition})" if partition != -1 else "")
    if code is not PreflightCode.OK:
        key = str(record.get("key", ""))
        return f"{where}: {_text(code, key if key in KEYS else '')}"
    if str(reply.content["meta"].get("settings", "")) != want:
        return (f"{where} runs other privfedcal settings than the server (method, clients, "
                "examples, DP, secure aggregation or calibration options differ): give "
                "every node and the server the same privfedcal.* settings")
    return None


def _ask_nodes(grid: Grid, s: PluginSettings) -> dict[int, int]:
    """Every node's preflight; their sample counts by partition id."""
    nodes = GridLink(grid, s.cfg.data.clients, s.options).wait_for_nodes()
    messages = [Message(RecordDict(), dst_node_id=n, message_type="query.preflight",
                        group_id="preflight") for n in nodes]
    replies = {int(r.metadata.src_node_id): r for r in grid.send_and_receive(
        messages, timeout=s.options.round_timeout)}
    sizes: dict[int, int] = {}
    for node in nodes:
        problem = _node_problem(node, replies.get(node), s.digest())
        if problem:
            raise PreflightError(problem)
        reply_ = replies[node]
        partition = int(str(reply_.content["meta"]["partition-id"]))
        if partition in sizes:
            raise PreflightError(f"two nodes have partition-id {partition}: give every node "
                                 "its own --node-config partition-id")
        sizes[partition] = int(str(reply_.content["metrics"]["num-examples"]))
    missing = sorted(set(range(s.cfg.data.clients)) - set(sizes))
    if missing:
        raise PreflightError(f"no node holds partition-id(s) {missing}: run "
                             f"{s.cfg.data.clients} nodes, or set privfedcal.clients")
    return sizes


def preflight(grid: Grid, model: nn.Module, context: Context | None = None, *,
              test_data: Any, method: str | None = None, head: str | None = None,
              num_classes: int | None = None, out: str | Path | None = None,
              batch_size: int = 256, batch_keys: tuple[str, str] | None = None,
              device: str = "cpu", **settings: Any) -> dict[int, int]:
    """Check, before training, everything ``calibrate`` with the same arguments would need
    (module docstring); returns the nodes' sample counts by partition id. Raises
    ``PreflightError`` (a one-line ``UsageError``) at the first failure. ``model`` may be
    untrained: its weights are not changed."""
    from privfedcal.flower.plugin import server_calibration as sc

    run_config = dict(context.run_config) if isinstance(context, Context) else {}
    with boundary(), torch_threads(threads_setting(settings, run_config)):
        sc._check_arguments(grid, context, test_data, batch_size)
        adapter = HeadAdapter(model, head, num_classes)
        s = sc._plugin_settings(grid, context, method, settings)
        sc._fresh_run_dir(out, s.method, int(context.run_id) if context is not None else 0)
        batch_kwargs = {"batch_size": batch_size, "batch_keys": batch_keys, "device": device,
                        "num_classes": adapter.num_classes}
        was = adapter.net.training
        try:
            sc._first_batch(test_data, batch_kwargs, adapter)
        finally:
            adapter.net.train(was)
        _plan(s, s.cfg.data.clients)  # the nodes' sizes unknown yet: checked again with them
        sizes = _ask_nodes(grid, s)
        _plan(s, sum(sizes.values()))
    log.info("privfedcal preflight: %d node(s) ready for %s", len(sizes), s.method)
    return sizes

