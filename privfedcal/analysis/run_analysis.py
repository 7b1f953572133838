"""Analyse a finished run folder the way the CCVR paper does (Luo et al., NeurIPS 2021).

- per-class classifier norms (sec. 3.2, fig. 3) and singular values (FedUV fig. 1) of the
  global model before post-hoc calibration (``checkpoint/`` ``global``) and of the final,
  evaluated model (``final/`` ``model``);
- linear CKA between client models, layer by layer (sec. 3.2, figs. 1-2): every client trains
  one more local round from the final global model, exactly as the engine would in round
  ``R + 1`` (same ``train_client``, same ``(seed, round, client)`` generator), and the client
  models are compared on the same test images;
- GMM separability (sec. 5.4, fig. 6): mean sliced Wasserstein distance between the class
  Gaussians of the final extractor's features on the training data all clients hold.

The math lives in :mod:`privfedcal.analysis`; this module only orchestrates and records
which checkpoint each number came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from privfedcal.analysis.cka import CKAResult, cka_matrix, layer_features
from privfedcal.analysis.classifier import classifier_norms, singular_values
from privfedcal.analysis.separability import mean_sliced_wasserstein
from privfedcal.errors import UsageError
from privfedcal.federation.checkpoint import load_checkpoint
from privfedcal.federation.local import train_client
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError
from privfedcal.settings.run_config import RunConfig
from privfedcal.tensors import State

__all__ = ["AnalysisOptions", "RunState", "analyze_run", "cka_layers", "classifier_weight_key",
           "client_cka", "load_run", "probe_indices", "separability"]

#: the pseudo-layer name of the representation z = model.features(x)
FEATURES = "features"
#: state-dict keys of the classifier weight: plain, then under a parametrisation (clsnorm)
WEIGHT_KEYS = ("classifier.weight", "classifier.parametrizations.weight.original")
#: generator purposes ``make_generator(seed, 0, 0, purpose)`` of the CKA probe images and the
#: sliced-Wasserstein directions (the engine uses 1..9 for its own draws)
PROBE_PURPOSE, SLICES_PURPOSE = 21, 22


@dataclass(frozen=True)
class AnalysisOptions:
    """``samples``: test images for CKA; ``projections``: sliced-Wasserstein directions;
    ``max_clients``: retrain only the first N clients (None: all); ``device``: override the
    run's device (None: as configured)."""

    samples: int = 500
    projections: int = 256
    max_clients: int | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise SettingError("{samples} must be >= 2 (CKA needs two inputs), got {got}",
                               got=self.samples)
        if self.projections < 1:
            raise SettingError("{projections} must be >= 1, got {got}", got=self.projections)
        if self.max_clients is not None and self.max_clients < 2:
            raise SettingError("{max_clients} must be >= 2 (CKA compares clients), got {got}",
                               got=self.max_clients)
        if self.device is not None and self.device not in ("auto", "cpu", "cuda"):
            raise SettingError(f"{{device}} must be auto, cpu or cuda, got {self.device!r}")


@dataclass
class RunState:
    """A run folder rebuilt: its experiment plus the states its checkpoints hold."""

    run_dir: Path
    exp: Any  # privfedcal.federation.setup.Experiment
    global_state: State
    final_state: State
    client_states: dict[int, State]

    @property
    def cfg(self) -> RunConfig:
        from privfedcal.experiment import config_of

        return config_of(self.exp)


def load_run(run_dir: Path, device: str | None = None) -> RunState:
    """Rebuild the experiment from ``config.json`` and load ``checkpoint/`` and ``final/``."""
    from privfedcal.experiment import build_experiment
    from privfedcal.settings.run_config import read_run_config

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    if device is not None:
        cfg = cfg.replace(device=device)
    for sub in ("checkpoint", "final"):
        if not (run_dir / sub).is_dir():
            hint = " (the run did not finish; resume it with privfedcal train --resume)" \
                if sub == "final" else ""
            raise UsageError(f"{run_dir} has no {sub}/ checkpoint{hint}")
    exp = build_experiment(cfg)
    ck = load_checkpoint(run_dir / "checkpoint", exp.device)
    final = load_checkpoint(run_dir / "final", exp.device)
    if not isinstance(ck.get("global"), dict) or not isinstance(final.get("model"), dict):
        raise UsageError(f"{run_dir}: checkpoint/ lacks 'global' or final/ lacks 'model'")
    clients = {int(c): s for c, s in (ck.get("clients") or {}).items()}
    run = RunState(run_dir, exp, ck["global"], final["model"], clients)
    for name, state in (("checkpoint/global", run.global_state), ("final/model", run.final_state)):
        _load(exp.model, state, name)
    return run


def _load(model: nn.Module, state: State, name: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise UsageError(f"{name} does not fit the model built from config.json: {first}") from None


def classifier_weight_key(state: State) -> str:
    """The state-dict key of the raw classifier weight (clsnorm stores it parametrised)."""
    for key in WEIGHT_KEYS:
        if key in state:
            return key
    raise UsageError(f"no classifier weight in the checkpoint (looked for {', '.join(WEIGHT_KEYS)})")


def _classifier_numbers(run: RunState) -> dict[str, Any]:
    key = classifier_weight_key(run.global_state)
    before, after = run.global_state[key], run.final_state[key]
    out: dict[str, Any] = {
        "weight_key": key,
        "before_source": "checkpoint/global",
        "after_source": "final/model",
        "calibrated": not torch.equal(before, after),
        "norms": {"before": classifier_norms(before).tolist(),
                  "after": classifier_norms(after).tolist()},
        "singular_values": {"before": singular_values(before).tolist(),
                            "after": singular_values(after).tolist()},
    }
    if key != WEIGHT_KEYS[0]:
        out["note"] = (f"norms of the raw weight {key}; the classifier applies it row-normalised, "
                       "so its effective rows all have norm 1")
    return out


def cka_layers(model: FeatureClassifier, probe: Tensor) -> list[str]:
    """Conv/Linear modules in the order a forward pass runs them, with the pseudo-layer
    ``features`` (z) just before the classifier. A module that runs more than once per pass is
    skipped, and so is one whose output *is* z (it would repeat the ``features`` column)."""
    classifier = getattr(model, "classifier", None)
    wanted = {name: m for name, m in model.named_modules()
              if isinstance(m, nn.Linear | nn.modules.conv._ConvNd) and name}
    calls: dict[str, int] = {}
    outputs: dict[str, Tensor] = {}

    def hook(name: str):
        def record(_m: nn.Module, _i: object, out: object) -> None:
            calls[name] = calls.get(name, 0) + 1
            if isinstance(out, Tensor):
                outputs[name] = out.detach()
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in wanted.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            z = model.features(probe)
            model.classifier(z)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    order = [n for n in calls if calls[n] == 1]  # dicts keep first-call order
    head = [n for n in order if wanted[n] is classifier]
    body = [n for n in order if wanted[n] is not classifier
            and not (outputs[n].shape == z.shape and torch.equal(outputs[n], z))]
    return [*body, FEATURES, *head]


def _client_features(model: FeatureClassifier, state: State, x: Tensor, layers: list[str]
                     ) -> dict[str, Tensor]:
    model.load_state_dict(state)
    modules = [name for name in layers if name != FEATURES]
    feats = layer_features(model, x, modules, batch_size=256)
    model.eval()
    with torch.no_grad():
        feats[FEATURES] = torch.cat([model.features(x[i:i + 256]) for i in range(0, x.shape[0], 256)])
    return {name: feats[name].float() for name in layers}


def probe_indices(num_test: int, samples: int, seed: int) -> Tensor:
    """Which test images CKA compares the clients on: a seeded random subset of ``samples``
    (all of them if the test set is smaller); random because test sets may be sorted by class."""
    order = torch.randperm(num_test, generator=make_generator(seed, 0, 0, PROBE_PURPOSE))
    return order[:min(samples, num_test)]


def client_cka(run: RunState, options: AnalysisOptions,
               on_client: Callable[[int], None] | None = None) -> tuple[CKAResult, dict[str, Any]]:
    """Retrain each client one round from ``checkpoint/global`` and compare them per layer."""
    exp, cfg = run.exp, run.cfg
    clients = cfg.data.clients
    k = clients if options.max_clients is None else min(clients, options.max_clients)
    if k < 2:
        raise UsageError("CKA between clients needs a run with at least 2 clients")
    x_test = exp.data.x_test
    pick = probe_indices(x_test.shape[0], options.samples, cfg.training.seed)
    probe, n = x_test[pick.to(x_test.device)], int(pick.numel())
    model = exp.model
    model.load_state_dict(run.global_state)
    layers = cka_layers(model, probe[:2])
    round_ = cfg.training.rounds + 1  # the round the engine would run next
    feature_sets = []
    for c in range(k):
        state, _, _ = train_client(model, exp.algo, run.global_state, run.client_states.get(c),
                                   exp.data.x_train, exp.data.y_train, exp.parts[c], exp.spec,
                                   round_, c)
        feature_sets.append(_client_features(model, state, probe, layers))
        if on_client is not None:
            on_client(c)
    result = cka_matrix(feature_sets, layers=layers)
    info = {"start": "checkpoint/global", "local_round": round_, "clients": k, "samples": n,
            "layers": list(result.layers)}
    return result, info


def separability(run: RunState, projections: int) -> dict[str, Any]:
    """Mean SW2 between the class Gaussians of the final extractor's training features."""
    from privfedcal.calibration.stats import ClassStats

    exp, cfg = run.exp, run.cfg
    model, data = exp.model, exp.data
    model.load_state_dict(run.final_state)
    model.eval()
    held = torch.cat(exp.parts)  # long-tail partitions drop samples: use the held ones
    stats = ClassStats.zeros(data.num_classes, model.feature_dim, device=exp.device)
    with torch.no_grad():
        for i in range(0, held.numel(), 2048):
            idx = held[i:i + 2048]
            z = model.features(data.x_train[idx])
            stats = stats + ClassStats.from_features(z, data.y_train[idx], data.num_classes)
    present = stats.present.nonzero().flatten().tolist()
    mean, cov = stats.mean(), stats.covariance()
    pairs = [(mean[c], cov[c]) for c in present]
    g = make_generator(cfg.training.seed, 0, 0, SLICES_PURPOSE)
    value = mean_sliced_wasserstein(pairs, projections, g)
    return {"mean_sliced_wasserstein": value, "order": 2, "projections": projections,
            "classes": present, "source": "final/model features on all clients' training data"}


def _finite(value: Any) -> Any:
    """JSON has no NaN: undefined numbers (CKA of a constant layer) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def analyze_run(run_dir: Path, options: AnalysisOptions | None = None, *,
                on_client: Callable[[int], None] | None = None,
                on_start: Callable[[int], None] | None = None,
                write: bool = True) -> dict[str, Any]:
    """Compute every analysis and, with ``write``, write the PNGs and ``analysis.json`` into
    ``run_dir``.

    ``on_start(k)`` is called with the number of clients about to be retrained and
    ``on_client(c)`` after each one (progress reporting). Returns the ``analysis.json`` dict
    (its ``plots`` name the PNGs written, none without ``write``).
    """
    from privfedcal.analysis.analysis_plots import (
        plot_cka,
        plot_classifier_norms,
        plot_singular_values,
    )

    options = options or AnalysisOptions()
    run = load_run(Path(run_dir), options.device)
    cfg, data = run.cfg, run.exp.data
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    classifier = _classifier_numbers(run)
    if on_start is not None:
        on_start(cfg.data.clients if options.max_clients is None
                 else min(cfg.data.clients, options.max_clients))
    cka, cka_info = client_cka(run, options, on_client)
    sep = separability(run, options.projections)

    out = Path(run_dir)
    names = data.classes if data.num_classes <= 20 else None
    norms, svals = classifier["norms"], classifier["singular_values"]
    if write:
        plot_classifier_norms(norms["before"], norms["after"], out / "classifier_norms.png",
                              names, labels=("global (checkpoint)", "final (after calibration)"))
        plot_singular_values({"global (checkpoint)": svals["before"],
                              "final (after calibration)": svals["after"]},
                             out / "singular_values.png")
        plot_cka(cka.mean, out / "cka.png")
    result = {
        "run_dir": str(out),
        "method": cfg.method,
        "calibrator": cfg.calibrator,
        "dataset": cfg.data.dataset,
        "model": run.exp.model_name,
        "classifier": classifier,
        "cka": {**cka_info, "mean": cka.mean,
                "matrices": {layer: m.tolist() for layer, m in cka.matrices.items()}},
        "separability": sep,
        "plots": ["classifier_norms.png", "cka.png", "singular_values.png"] if write else [],
    }
    result = _finite(result)
    if write:
        (out / "analysis.json").write_text(json.dumps(result, indent=2))
    return result
