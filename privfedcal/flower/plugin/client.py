"""The node's side of privfedcal's calibration, for a Flower ``ClientApp`` of one's own.

``CalibrationClient(model, data, head="fc3").attach(app)`` registers on the user's
``ClientApp`` the query handlers that privfedcal's server side sends
(``flower/flower_simulator.py``, ``flower/stage_messages.py``):

* ``query.preflight``: every check of the node before training (``preflight.py``): its
  settings, model, head and one batch of its data, answered with a code;
* ``query.hello``: the node's partition id and sample count, and the digest of its
  settings (``plugin_settings.py``), which the server checks against its own before any release;
* ``query.payload``: the calibrator's payload task (``flower/tasks.py``: a registered
  description, never a pickle) computed on the node's data under the model state the
  server sent, then the uplink's client halves (``flower/stage_messages.py`` ``client_upload``:
  the bound inside the task, this node's own DP noise from OS entropy, CKKS encryption under
  the key holder's public context, padding), counted in the node's own ledger
  (``flower/node_ledger.py``: a release past the planned count is refused before anything
  is computed);
* ``query.keygen`` / ``query.decrypt``: the CKKS key holder's role, on the node whose
  ``partition-id`` is ``flower.key-holder`` (``flower/stage_messages.py`` ``keygen``/``decrypt``);
* ``query.hold``: privfedcal's own ClientApp's hold (``flower.hold``);
* ``query.clip``: with ``dp-clip = "auto"``, the stages of the clip's private search
  (``clip.py``): noisy norm histograms, each stage once, then the chosen clip.

These are the handlers of privfedcal's own ClientApp (``flower/client_app.py``) with the
node's experiment replaced by the user's model (``HeadAdapter``) and data (``data.py``).
Every setting of the protection comes from the node's keyword arguments, run config and node
config (``plugin_settings.py``), never from a server's message; a task whose class is not the one
the node's calibrator declares for the release's label is refused. A handler that fails
sends its error's code only (``client_app.error_reply``), as privfedcal's ClientApp does.

What the plugin does not protect: the user's own messages (``train``, ``evaluate``), which
carry model updates and metrics as the user's app sends them (docs/flower.md).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from privfedcal.errors import UsageError
from privfedcal.flower.client_app import error_reply
from privfedcal.flower.client_app import hold as hold_handler
from privfedcal.flower.node_ledger import node_release
from privfedcal.flower.plugin import data as node_data
from privfedcal.flower.plugin.clip import CLIP_STATE, STAGES, keep_histogram, kept_histogram
from privfedcal.flower.plugin.plugin_settings import PluginSettings, from_keywords, gather, resolve
from privfedcal.flower.plugin.wording import (
    boundary,
    speaks_plugin,
    threads_setting,
    torch_threads,
)
from privfedcal.flower.records import as_int, record_at, record_to_state, tensor_to_array
from privfedcal.flower.stage_messages import SECAGG, client_upload, decrypt, keygen
from privfedcal.flower.tasks import TASK_ARRAYS, TASK_CONFIG, task_from_records
from privfedcal.models.head_adapter import HeadAdapter
from privfedcal.privacy.error_codes import Refused
from privfedcal.privacy.quantile import feature_norms, noisy_norm_histogram

__all__ = ["ACTIONS", "CalibrationClient"]

#: the query actions ``attach`` registers (message types ``query.<action>``)
ACTIONS = ("hello", "payload", "keygen", "decrypt", "hold", "clip", "preflight")


@dataclass
class NodeRun:
    """What one message needs: the node's settings, uplink and partition id."""

    settings: PluginSettings
    uplink: Any
    partition: int

    def meta(self) -> ConfigRecord:
        return ConfigRecord({"partition-id": self.partition})


def _call(source: Any, context: Context) -> Any:
    """``source`` itself, or what it returns: called with the node's Context if it takes
    an argument, else with none (a model class, ``lambda: loader``)."""
    if not callable(source) or isinstance(source, nn.Module):
        return source
    if inspect.isclass(source):  # a model class: built without arguments
        return source()
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(source).parameters
    except (TypeError, ValueError):
        params = {}
    wanted = [p for p in params.values() if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return source(context) if wanted else source()


class CalibrationClient:
    """A node's calibration handlers (module docstring).

    ``model``: the user's ``torch.nn.Module``, or a callable returning one (the model class,
    ``lambda: Net()``); its head is the ``Linear`` named ``head`` (or the last one; see
    ``HeadAdapter``). ``data``: the node's training data as a ``DataLoader`` or ``Dataset``,
    or a callable taking the node's ``Context`` (or nothing) and returning one (for data
    chosen by ``partition-id``); batches are ``(x, y)`` or mappings (``batch_keys``).
    ``num_classes``: the head's outputs by default. ``settings``: privfedcal's settings by
    keyword (``dp_eps=8.0, dp_clip=5.0, secagg=True, hide_counts=True, method="ccvr"``),
    overridden by the run config's and node config's ``privfedcal.*`` keys (plugin_settings.py).
    """

    def __init__(self, model: Any, data: Any, *, head: str | None = None,
                 num_classes: int | None = None, batch_size: int = 256,
                 batch_keys: tuple[str, str] | None = None, device: str = "cpu",
                 **settings: Any) -> None:
        if model is None or data is None:
            raise UsageError("CalibrationClient needs a model and the node's data")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if batch_keys is not None and (len(batch_keys) != 2
                                       or not all(isinstance(k, str) for k in batch_keys)):
            raise UsageError(f"batch_keys must be (inputs key, labels key), got {batch_keys!r}")
        self.model_source, self.data_source = model, data
        self.head, self.num_classes = head, num_classes
        self.batch_size, self.batch_keys, self.device = batch_size, batch_keys, device
        self.keywords = dict(settings)
        with speaks_plugin():  # an unknown name fails here, not at the first message
            from_keywords(self.keywords)
        self._adapter: HeadAdapter | None = None
        self._checked = False
        self._runs: dict[tuple[int, str, float | None], Any] = {}  # (run, digest, clip) -> uplink

    # ---- registration -------------------------------------------------------------------
    def attach(self, app: ClientApp) -> ClientApp:
        """Register the handlers on ``app`` (``query.hello``, ``query.payload``, ...);
        returns ``app``. A ClientApp that already handles one of them is refused."""
        if not isinstance(app, ClientApp):
            raise UsageError(f"attach takes a flwr ClientApp, got {type(app).__name__}")
        handlers: dict[str, Callable[[Message, Context], Message]] = {
            "preflight": self.preflight, "hello": self.hello, "payload": self.payload,
            "keygen": self.keygen, "decrypt": self.decrypt, "hold": hold_handler, "clip": self.clip}
        for action in ACTIONS:
            try:
                app.query(action)(self._coded(handlers[action]))
            except ValueError as exc:  # Flower's: already registered, or a client_fn app
                raise UsageError(f"cannot register query.{action} on this ClientApp: "
                                 f"{str(exc).splitlines()[0]}") from None
        return app

    def _coded(self, fn: Callable[[Message, Context], Message]
               ) -> Callable[[Message, Context], Message]:
        """``fn`` at the plugin's boundary (``wording.boundary``: the node's log in the
        plugin's words, the root logger kept; ``privfedcal.threads``), whose exceptions
        become an error reply carrying their code only."""
        def handler(msg: Message, context: Context) -> Message:
            try:
                threads = threads_setting(self.keywords, context.run_config,
                                          context.node_config)
                with boundary(), torch_threads(threads):
                    return fn(msg, context)
            except Exception as exc:  # noqa: BLE001 - answered with its code only
                return error_reply(msg, exc)
        handler.__name__ = getattr(fn, "__name__", "handler")
        return handler

    # ---- the node's parts ------------------------------------------------------------------
    def build_model(self, context: Context) -> Any:
        """The user's model for this node (``model``, or what calling it returns)."""
        return _call(self.model_source, context)

    def adapter(self, context: Context) -> HeadAdapter:
        if self._adapter is None:
            model = self.build_model(context)
            self._adapter = HeadAdapter(model, self.head, self.num_classes)
            self._adapter.to(self.device)
        return self._adapter

    def data(self, context: Context) -> Any:
        return _call(self.data_source, context)

    def _batches_kwargs(self, adapter: HeadAdapter) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "batch_keys": self.batch_keys,
                "device": self.device, "num_classes": adapter.num_classes}

    def node_settings(self, context: Context) -> tuple[PluginSettings, int]:
        """The node's settings, from its own configuration, and its partition id."""
        nc = context.node_config
        if "partition-id" not in nc:
            raise UsageError("this node has no partition-id: start it with --node-config "
                             "'partition-id=K num-partitions=N' (K in 0..N-1)")
        partition = int(nc["partition-id"])
        parts = nc.get("num-partitions")
        settings = resolve(gather(self.keywords, context.run_config, nc),
                           clients=None if parts is None else int(parts))
        if not 0 <= partition < settings.cfg.data.clients:
            raise UsageError(f"node partition-id={partition} is outside "
                             f"0..{settings.cfg.data.clients - 1}")
        return settings, partition

    def node_run(self, context: Context) -> NodeRun:
        """The node's settings, partition id and uplink (with dp-clip = "auto", planned
        with the clip the server sent at the end of the clip's search)."""
        from privfedcal.experiment import calibrator_class
        from privfedcal.privacy.executor import execute_plan
        from privfedcal.privacy.planner import plan_for_run
        from privfedcal.settings.floors import PrivacyOptions

        settings, partition = self.node_settings(context)
        clip = None
        if settings.auto_clip is not None:
            clip = clip_record(context).get("clip")
            if clip is None:
                raise UsageError("dp-clip is 'auto' and the server has not sent the clip of "
                                 "its search (query.clip) yet")
            settings = dataclasses.replace(settings, cfg=settings.cfg.replace(dp_clip=clip))
        key = (int(context.run_id), settings.digest(), clip)
        if key not in self._runs:
            # the public N the plan uses (settings.examples); unset, this node's own size
            # stands in for the planner's range checks (delta was fixed without it)
            n = settings.examples or self.size(context)
            # with dp-clip = "auto", the search's noise in the run's one plan, as the server's
            preset = settings.auto_clip.preset() if settings.auto_clip is not None else None
            uplink = execute_plan(plan_for_run(PrivacyOptions.of(settings.cfg),
                                               calibrator_class(settings.cfg), n, preset))
            self._runs = {key: uplink}
        return NodeRun(settings, self._runs[key], partition)

    def size(self, context: Context) -> int:
        adapter = self.adapter(context)
        return node_data.num_samples(self.data(context), **self._batches_kwargs(adapter))

    # ---- handlers -----------------------------------------------------------------------
    def preflight(self, msg: Message, context: Context) -> Message:
        """Every check of this node before training (``preflight.py``): a code, never text."""
        from privfedcal.flower.plugin.preflight import reply

        return reply(self, msg, context)

    def hello(self, msg: Message, context: Context) -> Message:
        settings, partition = self.node_settings(context)
        meta = ConfigRecord({"partition-id": partition, "num-partitions": settings.cfg.data.clients,
                             "settings": settings.digest()})
        return Message(RecordDict({"meta": meta, "metrics": MetricRecord(
            {"num-examples": self.size(context)})}), reply_to=msg)

    def payload(self, msg: Message, context: Context) -> Message:
        from privfedcal.experiment import calibrator_class

        run = self.node_run(context)
        content = msg.content
        config = record_at(content, "config", ConfigRecord)
        label = str(config["label"])
        declared = {r.label: r.task for r in calibrator_class(run.settings.cfg).releases}
        with node_release(context, run.uplink, label):
            task = task_from_records(record_at(content, TASK_CONFIG, ConfigRecord),
                                     record_at(content, TASK_ARRAYS, ArrayRecord), self.device)
            if declared.get(label) is not type(task):
                raise Refused(f"release {label!r} with task {type(task).__name__} is not "
                              f"one this node's {run.settings.method} makes")
            adapter = self.adapter(context)
            adapter.load_state_dict(record_to_state(record_at(content, "state", ArrayRecord),
                                                    self.device))
            adapter.eval()
            data = self.data(context)
            kwargs = self._batches_kwargs(adapter)
            if not self._checked:
                x, _ = next(iter(node_data.batches(data, **kwargs)))
                adapter.check(x)
                self._checked = True
            upload = node_data.compute(task, adapter, data, run.uplink.bound, **kwargs)
            records = client_upload(run.uplink, upload, label=label,
                                    round_=as_int(config["round"]), client=run.partition,
                                    secagg=content.config_records.get(SECAGG))
        return Message(RecordDict({"meta": run.meta(), **records}), reply_to=msg)

    def _key_holder(self, context: Context) -> int:
        settings, partition = self.node_settings(context)
        if not (settings.cfg.privacy.secagg and partition == settings.options.key_holder):
            raise UsageError(f"client {partition} is not this run's CKKS key holder")
        return partition

    def keygen(self, msg: Message, context: Context) -> Message:
        partition = self._key_holder(context)
        records = dict(keygen(context, record_at(msg.content, "config", ConfigRecord)))
        return Message(RecordDict({"meta": ConfigRecord({"partition-id": partition}),
                                   **records}), reply_to=msg)

    def decrypt(self, msg: Message, context: Context) -> Message:
        self._key_holder(context)
        run = self.node_run(context)
        records = dict(decrypt(context, record_at(msg.content, "config", ConfigRecord),
                               run.uplink))
        return Message(RecordDict({"meta": run.meta(), **records}), reply_to=msg)

    def clip(self, msg: Message, context: Context) -> Message:
        """One stage of the clip's search (clip.py): stage 1 and 2 a noisy histogram of the
        node's feature norms under the server's model, each drawn once (asked again, the
        node re-sends the one it released: ``kept_histogram``); stage 3 the clip the
        server chose, kept for the calibration release."""
        settings, partition = self.node_settings(context)
        auto = settings.auto_clip
        if auto is None:
            raise Refused("this node's dp-clip is not 'auto': it sends no norm histogram")
        config = msg.content["config"]
        stage = config.get("stage")
        record = clip_record(context)
        meta = ConfigRecord({"partition-id": partition})
        if stage == 3:
            clip = auto.check_clip(config.get("clip"))
            if record.get("clip") not in (None, clip):
                raise UsageError("the server sent a second, different clip for this run")
            save_clip_record(context, {**record, "clip": clip})
            return Message(RecordDict({"meta": meta}), reply_to=msg)
        if not isinstance(stage, int) or stage not in STAGES:
            raise UsageError(f"clip stage must be 1, 2 or 3, got {stage!r}")
        histogram = kept_histogram(record, stage, config.get("centre"))
        if histogram is None:  # not released yet: drawn, kept, then sent
            histogram = self._histogram(msg, context, auto, stage, config.get("centre"))
            save_clip_record(context, keep_histogram(record, stage, config.get("centre"),
                                                     histogram))
        return Message(RecordDict({"meta": meta, "histogram": ArrayRecord(
            {"counts": tensor_to_array(histogram)})}), reply_to=msg)

    def _histogram(self, msg: Message, context: Context, auto: Any, stage: int,
                   centre: Any) -> Any:
        """This node's noisy histogram of its feature norms for ``stage`` (clip.py)."""
        edges = auto.edges(stage, centre)
        adapter = self.adapter(context)
        adapter.load_state_dict(record_to_state(record_at(msg.content, "state", ArrayRecord),
                                                self.device))
        adapter.eval()
        kwargs = self._batches_kwargs(adapter)
        norms = feature_norms(adapter.features,
                              (x for x, _ in node_data.batches(self.data(context), **kwargs)))
        return noisy_norm_histogram(norms, edges, auto.stage_sigma(stage))


def clip_record(context: Context) -> dict[str, Any]:
    """The node's record of this run's clip search (``CLIP_STATE``): stages made, clip."""
    kept = context.state.config_records.get(CLIP_STATE)
    if kept is None or as_int(kept["run-id"]) != int(context.run_id):
        return {"run-id": int(context.run_id)}
    return dict(kept)


def save_clip_record(context: Context, record: dict[str, Any]) -> None:
    context.state[CLIP_STATE] = ConfigRecord(record)
