"""The server's side of privfedcal's calibration, for a Flower ``ServerApp`` of one's own:
one call after the user's strategy has trained the model.

    result = strategy.start(grid=grid, initial_arrays=..., num_rounds=...)
    model.load_state_dict(result.arrays.to_torch_state_dict())
    summary = calibrate(grid, model, context, method="ccvr", head="fc3", test_data=testloader)

What is shared with privfedcal's own ServerApp, unchanged:

* ``FlowerSimulator`` (``flower/flower_simulator.py``): ``collect`` (the release opened by the uplink,
  the task sent as a description with the model state, the replies through
  ``Uplink.server_side``: uploads validated, a malformed or NaN one rejected and named in
  ``rejected_uploads``, lost nodes named in ``dropped_clients``, the noise topped up for
  them), the CKKS key holder as a node (``RemoteKeys``), the dropout rule
  (``flower.min-replies``, never below ``cohorts.secure_minimum`` for a secure sum),
  ``finish`` (the calibrator's post-hoc step, the evaluation, summary.json with
  ``privacy`` and its ``whole_run`` check of the secure sums, the notes);
* ``GridLink`` (``flower/link.py``): every exchange, deadlines, error replies kept as codes;
* the planner (``privacy/planner.py`` ``plan_protection``): the releases the calibrator declares
  (``ReleaseSpec``), the noise plan, accountant and budget ledger (``DPAccounting``), CKKS
  set-up, hidden counts, cohorts and minimum contributors, all from privfedcal's
  ``RunConfig`` built from the plugin's settings (``plugin_settings.py``), as every node builds it;
* the calibrators (``calibration/ccvr.py``, ``calibration/creff.py``) and the run folder
  (``config.json``, ``server/transcript/``, ``summary.json``, ``metrics.jsonl``, ``final/``).

What is the plugin's own: the server's experiment wraps the user's model (``HeadAdapter``)
and test data (evaluated batch by batch) instead of a privfedcal dataset; the nodes'
sample counts come from ``query.hello`` (checked with the digest of each node's settings
before any release); training is the user's, so the loop runs the calibration only: CCVR's
one release, or CReFF's ``rounds`` rounds of class-gradient releases on the final
extractor. The calibrated head is written into the user's model, under its own parameter
names, and the run's ``final/`` checkpoint holds the user's state dict.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.federation.checkpoint import save_checkpoint
from privfedcal.federation.runfolder import write_summary
from privfedcal.flower.flower_simulator import FlowerSimulator
from privfedcal.flower.link import FlowerRoundError, GridLink
from privfedcal.flower.plugin import data as plugin_data
from privfedcal.flower.plugin.clip import ClipOutcome, choose_clip, stage_label
from privfedcal.flower.plugin.plugin_settings import PluginSettings, gather, resolve
from privfedcal.flower.plugin.wording import boundary, threads_setting, torch_threads
from privfedcal.flower.records import as_int, record_at
from privfedcal.models.head_adapter import HeadAdapter
from privfedcal.privacy.plan import PresetNoise
from privfedcal.privacy.quantile import QUANTILE_RELEASE
from privfedcal.privacy.stages import NoiseStage
from privfedcal.settings.run_config import RunConfig
from privfedcal.tensors import State

__all__ = ["PluginSimulator", "calibrate"]

log = logging.getLogger("privfedcal.flower")


@dataclass
class ServerData:
    """What the server's experiment holds of data: the classes, an empty batch of the test
    inputs' shape (the example payload's input) and the user's test data."""

    name: str
    num_classes: int
    x_test: Tensor
    y_test: Tensor
    test: Any


class PluginSimulator(FlowerSimulator):
    """``FlowerSimulator`` over the user's model and test data, running calibration only."""

    batch_kwargs: dict[str, Any]
    accuracy_before: float | None = None

    def evaluate(self, state: State, transform: Any = None) -> dict[str, Any]:
        """``Simulator.evaluate`` over the user's test batches (same fields)."""
        key = (id(state), id(transform))
        if self._last_eval is not None and self._last_eval[0] == key:
            return self._last_eval[2]
        model, c = self.exp.model, self.exp.data.num_classes
        model.load_state_dict(state)
        model.eval()
        correct = torch.zeros(c, dtype=torch.float64)
        seen = torch.zeros(c, dtype=torch.float64)
        loss = 0.0
        with torch.no_grad():
            for x, y in plugin_data.batches(self.exp.data.test, **self.batch_kwargs):
                z = model.features(x)
                logits = model.classifier(z if transform is None else transform(z)).float()
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
                hit = (logits.argmax(1) == y).double().cpu()
                correct.index_add_(0, y.cpu(), hit)
                seen.index_add_(0, y.cpu(), torch.ones_like(hit))
        n = float(seen.sum())
        if n == 0:
            raise UsageError("test_data is empty")
        per_class = [None if s == 0 else round(float(k / s), 6)
                     for k, s in zip(correct.tolist(), seen.tolist(), strict=True)]
        result = {"accuracy": float(correct.sum()) / n, "loss": loss / n,
                  "per_class_accuracy": per_class}
        self._last_eval = (key, (state, transform), result)
        return result

    def extra_summary(self) -> dict[str, Any]:
        extra = super().extra_summary()
        model = self.exp.model
        extra["plugin"] = {"model": type(model.net).__name__, "head": model.head_name,
                           "nodes": self.loop.data.clients, "examples": self.exp.num_examples}
        # CCVR's head, once installed, recorded the accuracy before (PosthocCalibrator);
        # CReFF, or a CCVR release that was skipped, did not
        if getattr(self.calibrator, "_head", None) is None:
            extra["accuracy_before_calibration"] = self.accuracy_before
        return extra

    def run_calibration(self) -> dict[str, Any]:
        """The calibrator's rounds on the final model (CReFF's per-round releases), then
        ``finish`` (CCVR's release, the evaluation, summary.json); returns the summary."""
        start = time.perf_counter()
        self.accuracy_before = self.evaluate(self.global_state)["accuracy"]
        per_round = any(r.participants != "all" for r in self.calibrator.releases)
        for round_ in range(1, self.loop.training.rounds + 1) if per_round else ():
            t0 = time.perf_counter()
            self.calibrate_round(round_, self.global_state, self.select_clients(round_))
            ev = self.evaluate(self.checked_eval_state(round_))
            record = {"round": round_, "train_loss": None, "accuracy": ev["accuracy"],
                      "loss": ev["loss"], "per_class_accuracy": ev["per_class_accuracy"],
                      "seconds": round(time.perf_counter() - t0, 4)}
            info = getattr(self.calibrator, "last_round_info", None)
            if info:
                record["calibration"] = info
            self.history.append(record)
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self.elapsed += time.perf_counter() - start
        return self.finish()


def _server_settings(grid: Grid, run_config: dict[str, Any], keywords: dict[str, Any]
                     ) -> PluginSettings:
    nodes = len(list(grid.get_node_ids()))
    return resolve(gather(keywords, run_config), clients=nodes or None)


def _hello(link: GridLink, settings: PluginSettings) -> dict[int, int]:
    """Every node's sample count, after checking that it runs these settings."""
    want = settings.digest()
    sizes: dict[int, int] = {}
    other: list[int] = []
    for client, reply in sorted(link.discover().items()):
        if str(reply.content["meta"].get("settings", "")) != want:
            other.append(client)
        sizes[client] = as_int(record_at(reply.content, "metrics", MetricRecord)["num-examples"])
    if other:
        raise FlowerRoundError(
            f"client(s) {other} run other privfedcal settings than the server (method, "
            "clients, examples, DP, secure aggregation or calibration options differ): "
            "give every node and the server the same privfedcal.* settings")
    missing = sorted(set(range(settings.cfg.data.clients)) - set(sizes))
    if missing:
        raise FlowerRoundError(f"no node holds partition-id(s) {missing}")
    return sizes


def _check_arguments(grid: Any, context: Any, test_data: Any, batch_size: Any) -> None:
    """``calibrate``'s arguments that its settings do not check: a ``UsageError`` each."""
    if not isinstance(grid, Grid):
        raise UsageError(f"grid must be the ServerApp's flwr Grid, got {type(grid).__name__}")
    if context is not None and not isinstance(context, Context):
        raise UsageError(f"context must be the ServerApp's flwr Context or None, got "
                         f"{type(context).__name__}")
    if test_data is None:
        raise UsageError("calibrate needs test_data: the server's test DataLoader or Dataset")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}")


def _server_side(cfg: RunConfig, adapter: HeadAdapter, test_data: Any, x: Tensor, n: int,
                 device: str, preset: PresetNoise | None = None) -> tuple[Any, Any, Any]:
    """The server's experiment (the user's model behind its adapter, the server's test data
    and no training data), its calibrator and the uplink the planner gives them for ``n``
    examples in all (``preset``: the clip search's noise, planned with the run's)."""
    from privfedcal.algorithms import create_algorithm
    from privfedcal.experiment import build_calibrator
    from privfedcal.federation.setup import Experiment
    from privfedcal.privacy.executor import execute_plan
    from privfedcal.privacy.planner import plan_for_run
    from privfedcal.settings.floors import DataOptions, LoopOptions, PrivacyOptions

    data = ServerData(cfg.data.dataset, adapter.num_classes, x[:0],
                      torch.zeros(0, dtype=torch.long, device=x.device), test_data)
    # the server trains no client: no model builder and no local-training spec
    exp = Experiment(torch.device(device), data, None, None, adapter,  # type: ignore[arg-type]
                     create_algorithm("fedavg", num_classes=adapter.num_classes),
                     None, None,  # type: ignore[arg-type]
                     DataOptions.of(cfg), cfg.engine, PrivacyOptions.of(cfg),
                     LoopOptions.of(cfg), cfg.model or type(adapter.net).__name__,
                     record=cfg.to_dict(), num_examples=n)
    calibrator = build_calibrator(cfg, exp)
    return exp, calibrator, execute_plan(plan_for_run(exp.privacy, calibrator, n, preset))


def _holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ("summary.json", "metrics.jsonl", "server"))


def _fresh_run_dir(out: str | Path | None, method: str, run_id: int) -> Path:
    """The run folder, checked before any message so that a run is never half-written:
    writable, and holding no earlier run. By default the first free one of
    ``runs/flower-plugin-<method>-<run id>``, then ``...-<run id>-2``, ``-3``...: a run
    repeated from the same folder (the same Flower run id) never meets the one before."""
    from privfedcal.report.output_folder import check_writable

    if out:
        run_dir = Path(out)
    else:
        base = Path("runs") / f"flower-plugin-{method}-{run_id}"
        run_dir = next(d for k in range(1, 10_000)
                       if not _holds_run(d := base if k == 1 else Path(f"{base}-{k}")))
    check_writable(run_dir, "out")
    if _holds_run(run_dir):
        raise UsageError(f"{run_dir} already holds a run: give calibrate another out")
    return run_dir


def _charge_search(uplink: Any, searched: ClipOutcome, sizes: dict[int, int]) -> None:
    """The clip search's stages (planned in the run's one plan) charged to every node asked
    (a lost node may have released its histogram)."""
    dp = uplink.find(NoiseStage).dp
    for stage in searched.histograms:
        dp.record(stage_label(stage), sorted(sizes))


def _record_search(sim: PluginSimulator, searched: ClipOutcome) -> None:
    """The nodes' clip-search histograms in the server's view (round 0), and its notes."""
    for stage, histograms in searched.histograms.items():
        for client, counts in histograms.items():
            sim.transcript.record(round_=0, label=QUANTILE_RELEASE, view="plain-upload",
                                  client=client, tensors={f"stage{stage}": counts})
    sim.notes += searched.notes


def calibrate(grid: Grid, model: torch.nn.Module, context: Context | None = None, *,
              test_data: Any, method: str | None = None, head: str | None = None,
              num_classes: int | None = None, out: str | Path | None = None,
              batch_size: int = 256, batch_keys: tuple[str, str] | None = None,
              device: str = "cpu", updates: Any = None, **settings: Any) -> dict[str, Any]:
    """Calibrate ``model``'s head with CCVR or CReFF over the nodes of ``grid``, under every
    protection the settings ask for; returns the run's summary (summary.json).

    ``model``: the trained ``torch.nn.Module`` (its head ``head``, or the last ``Linear``);
    its head is replaced in place by the calibrated one, under its own parameter names
    (the model is moved to ``device``).
    ``context``: the ServerApp's Context, whose run config's ``privfedcal.*`` keys override
    the keyword ``settings`` (``dp_eps``, ``dp_clip``, ``secagg``, ``hide_counts``, ``rounds``,
    ``key_holder``, ``min_replies``, ``examples``, ``calibration_params``, ``threads``...;
    plugin_settings.py).
    ``method``: ``"ccvr"`` (default) or ``"creff"``. ``test_data``: the server's test
    ``DataLoader`` or ``Dataset`` (accuracy before and after). ``out``: the run folder
    (default: the first free ``runs/flower-plugin-<method>-<run id>[-k]`` under the
    working folder). The nodes must run
    ``CalibrationClient`` with the same settings (checked before any release; ``preflight``
    checks them before training). On failure ``model`` is left as it was (its weights
    restored) and the error names the plugin's keys (``privfedcal.dp-eps``).
    ``updates``: the ``PrivateUpdates`` that trained the model (dp_fedavg.py), whose
    charges the run's one ledger takes over.
    """
    kept = ({k: v.detach().clone() for k, v in model.state_dict().items()}
            if isinstance(model, torch.nn.Module) else None)
    run_config = dict(context.run_config) if isinstance(context, Context) else {}
    try:
        with boundary(), torch_threads(threads_setting(settings, run_config)):
            return _calibrate(grid, model, context, test_data, method, head, num_classes, out,
                              batch_size, batch_keys, device, updates, settings)
    except BaseException:
        if kept is not None:  # a failure never loses the trained model
            model.load_state_dict(kept)
        raise


def _calibrate(grid: Grid, model: torch.nn.Module, context: Context | None, test_data: Any,
               method: str | None, head: str | None, num_classes: int | None,
               out: str | Path | None, batch_size: int, batch_keys: tuple[str, str] | None,
               device: str, updates: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``calibrate``'s run (its docstring)."""
    _check_arguments(grid, context, test_data, batch_size)
    run_id = int(context.run_id) if context is not None else 0
    adapter = HeadAdapter(model, head, num_classes)
    adapter.to(device)
    s = _plugin_settings(grid, context, method, settings)
    run_dir = _fresh_run_dir(out, s.method, run_id)
    link = GridLink(grid, s.cfg.data.clients, s.options)
    sizes = _hello(link, s)
    n = s.examples or sum(sizes.values())
    batch_kwargs = {"batch_size": batch_size, "batch_keys": batch_keys, "device": device,
                    "num_classes": adapter.num_classes}
    x = _first_batch(test_data, batch_kwargs, adapter)
    cfg = s.cfg.replace(out=str(run_dir), model=type(model).__name__)
    searched = None
    if s.auto_clip is not None:  # dp-clip = "auto": the nodes' private search (clip.py)
        searched = choose_clip(link, adapter.state_dict(), s.auto_clip, sizes,
                               s.options.min_replies or None)
        cfg = cfg.replace(dp_clip=searched.clip)
    preset = s.auto_clip.preset() if s.auto_clip is not None else None
    exp, calibrator, uplink = _server_side(cfg, adapter, test_data, x, n, device, preset)
    if updates is not None:  # DP-FedAvg's rounds, in the same ledger (dp_fedavg.py)
        updates.hand_over(s, uplink.find(NoiseStage).dp)
    if searched is not None and s.auto_clip is not None:
        _charge_search(uplink, searched, sizes)
    sim = PluginSimulator(exp, run_dir, link, calibrator=calibrator, uplink=uplink,
                          key_holder=s.options.key_holder,
                          run_record={"flower_run_id": run_id})
    sim.batch_kwargs = batch_kwargs
    sim.sizes = dict(sizes)
    if searched is not None:  # what the server saw of the search, in its view
        _record_search(sim, searched)
    summary = sim.run_calibration()
    if searched is not None and s.auto_clip is not None:
        _summarise_search(summary, s.auto_clip, searched, run_dir)
    _install_calibrated(sim, adapter, run_dir)
    link.close()
    log.info("privfedcal %s: accuracy %.4f -> %.4f", s.method,
             summary.get("accuracy_before_calibration") or float("nan"), summary["accuracy"])
    return summary


def _plugin_settings(grid: Grid, context: Context | None, method: str | None,
                     settings: dict[str, Any]) -> PluginSettings:
    """The run's settings: the keyword ``settings`` (and ``method``) under the Context's run
    config; refuses CCVR's tukey option, which the model's own forward cannot apply."""
    keywords = dict(settings)
    if method is not None:
        keywords["method"] = method
    run_config = dict(context.run_config) if context is not None else {}
    s = _server_settings(grid, run_config, keywords)
    if s.cfg.calibration_params.get("tukey"):
        raise UsageError("CCVR's tukey option transforms features at inference, which the "
                         "model's own forward does not: leave it off in the plugin")
    return s


def _first_batch(test_data: Any, batch_kwargs: dict[str, Any], adapter: HeadAdapter) -> Any:
    """The test data's first batch of inputs, checked against the model's head."""
    x, _ = next(iter(plugin_data.batches(test_data, **batch_kwargs)), (None, None))
    if x is None:
        raise UsageError("test_data is empty")
    adapter.check(x)
    return x


def _summarise_search(summary: dict[str, Any], auto_clip: Any, searched: ClipOutcome,
                      run_dir: Path) -> None:
    """The clip search in summary.json: the privacy statement covers the search and the
    calibration (one accountant)."""
    spent = summary.get("privacy", {}).get("epsilon_spent")
    summary["plugin"]["feature_clip"] = auto_clip.summary(searched.clip, searched.centre, spent)
    write_summary(run_dir, summary)


def _install_calibrated(sim: PluginSimulator, adapter: HeadAdapter, run_dir: Path) -> None:
    """The calibrated head into the user's model, and the run's final model saved under the
    user's names (loadable into the user's model)."""
    final = sim.calibrator.eval_state(sim.global_state)
    adapter.load_state_dict(final)
    save_checkpoint(run_dir / "final", {"model": adapter.user_state(final)})
