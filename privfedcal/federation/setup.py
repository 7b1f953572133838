"""Build an experiment (data, partition, model, method, calibrator) from a RunConfig.

The experiment holds the *resolved* config: settings left None are filled per model and
dataset (``config.resolve_training_defaults``) once the data is loaded, and the data seed
(``resolve_data_seed``) once the partition is drawn.

Two seeds (docs/threat-model.md): the protocol seed ``--seed`` is public (the server holds
it: it picks clients and initialises models); the data seed draws the partition, which only
the clients hold. ``build_server_experiment`` is the server's side: the model, the test set
and public sizes, never the training samples or the partition.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from privfedcal.algorithms import create_algorithm
from privfedcal.algorithms.algorithm import Algorithm
from privfedcal.config import MODEL_MIN_INPUT, RunConfig, resolve_training_defaults
from privfedcal.errors import UsageError
from privfedcal.federation.local import (
    LocalSpec,
    choose_mixed_precision,
    set_deterministic,
)
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import make_generator


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    return torch.device(name)


def build_model_and_algo(cfg_dict: dict[str, Any], num_classes: int, in_channels: int,
                         image_size: int) -> tuple[FeatureClassifier, Algorithm]:
    """The same model + method objects in the server and in every worker (picklable)."""
    from privfedcal.data.datasets import default_model_for
    from privfedcal.models import create_model

    cfg = RunConfig.from_dict(cfg_dict)
    algo = create_algorithm(cfg.local_method, num_classes=num_classes, **cfg.method_params)
    model = create_model(cfg.model or default_model_for(cfg.dataset, image_size=image_size), num_classes=num_classes,
                         in_channels=in_channels, image_size=image_size,
                         generator=make_generator(cfg.seed, 0, 0, 7))
    if cfg.dp_train:  # BatchNorm has no per-sample gradient: GroupNorm for the whole run
        from privfedcal.privacy.dpsgd import prepare_model

        model = prepare_model(model)
    algo.configure_model(model, make_generator(cfg.seed, 0, 0, 8))
    return model, algo


def partition_is_secret(cfg: RunConfig) -> bool:
    """Whether the run's protections claim something the server could read off a public
    partition: any DP, secure aggregation or hidden counts. A server that can redraw the
    partition of a public dataset knows every client's examples, so their partition must
    come from a seed it does not hold. ``--insecure-seeded-noise`` declares the run insecure
    against anyone who knows the seed: its partition follows the seed too."""
    protected = (cfg.dp_enabled or cfg.dp_train or cfg.secagg or cfg.secagg_updates
                 or cfg.hide_counts)
    return protected and not cfg.insecure_seeded_noise


def resolve_data_seed(cfg: RunConfig) -> int:
    """The seed of the partition: ``--data-seed`` when given; else, under a protection
    (``partition_is_secret``), 63 bits of OS entropy (recorded on the experimenter's side of
    the run folder only, so ``--config RUN/config.json`` redraws the same partition); else
    ``--seed`` (a plain run's partition is public and reproducible)."""
    if cfg.data_seed is not None:
        return cfg.data_seed
    if partition_is_secret(cfg):
        return secrets.randbits(63)
    return cfg.seed


#: the settings that decide which examples a client holds (besides the secret data seed)
PARTITION_SETTINGS = ("dataset", "partition", "clients", "alpha", "imbalance_factor",
                      "shards_per_client", "min_size")


def partition_settings_digest(cfg: RunConfig) -> str:
    """A digest of the public data settings, by which a Flower node shows the server it
    partitions as the run says (the server cannot redraw the partition to check)."""
    import hashlib
    import json

    d = cfg.to_dict()
    text = json.dumps({k: d[k] for k in PARTITION_SETTINGS}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def held_examples(labels: np.ndarray, cfg: RunConfig) -> int:
    """How many training examples the clients hold together: a function of the public
    dataset and partition scheme, not of the draw (long-tail shaping keeps a fixed number
    per class; every other scheme deals out every example). The server plans DP and secure
    aggregation with it, as the clients do, without the partition."""
    from privfedcal.data.partition import longtail_counts

    if cfg.partition in ("longtail", "longtail-dirichlet"):
        return int(longtail_counts(np.bincount(labels), cfg.imbalance_factor).sum())
    return int(len(labels))


@dataclass
class Experiment:
    cfg: RunConfig
    device: torch.device
    data: Any  # privfedcal.data.datasets.Dataset, on device
    parts: list[Tensor] | None  # per-client index tensors on device; None on the server
    counts: np.ndarray | None  # (K, C) class counts; None on the server
    model: FeatureClassifier
    algo: Algorithm
    builder: functools.partial
    spec: LocalSpec

    warnings: list[str] = dataclasses.field(default_factory=list)
    #: training examples the clients hold together (public: ``held_examples``)
    num_examples: int = 0

    @property
    def model_name(self) -> str:
        from privfedcal.data.datasets import default_model_for

        return self.cfg.model or default_model_for(self.data)

    def partition_record(self) -> dict[str, Any]:
        """What ``partition.json`` holds: the spec, per-client class counts and indices."""
        from privfedcal.data.partition import client_sources

        cfg, d = self.cfg, self.data
        if self.parts is None or self.counts is None:
            raise ValueError("the server's experiment holds no partition")
        record = {
            "dataset": d.name, "partition": cfg.partition, "clients": cfg.clients,
            "alpha": cfg.alpha, "imbalance_factor": cfg.imbalance_factor,
            "shards_per_client": cfg.shards_per_client, "min_size": cfg.min_size,
            "seed": cfg.seed, "data_seed": cfg.data_seed, "classes": d.classes, "num_train": d.num_train,
            "num_assigned": int(self.counts.sum()), "sizes": self.counts.sum(axis=1).tolist(),
            "class_totals": self.counts.sum(axis=0).tolist(), "counts": self.counts.tolist(),
            "indices": [p.tolist() for p in self.parts],
        }
        record.update(client_sources(d, cfg.partition))  # private, as the indices
        return record


def fit_warning(model: str, dataset: str, image_size: int) -> str | None:
    """A warning when ``model`` is built for larger inputs than the dataset's images."""
    need = MODEL_MIN_INPUT.get(model)
    if need is None or image_size >= need:
        return None
    return (f"model {model} is built for images of at least {need}x{need} pixels but "
            f"{dataset} has {image_size}x{image_size} images: it may train no better than "
            f"chance (the dataset's default model fits)")


def _finish(cfg: RunConfig, data: Any, parts_np: list[np.ndarray] | None,
            counts: np.ndarray | None, num_examples: int) -> Experiment:
    from privfedcal.data.datasets import default_model_for

    device = resolve_device(cfg.device)
    cfg = resolve_training_defaults(cfg, model=default_model_for(data), augment=data.augment)
    warning = fit_warning(cfg.model, cfg.dataset, data.image_size)
    data = data.to(device)
    parts = None if parts_np is None else [
        torch.as_tensor(p, dtype=torch.long, device=device) for p in parts_np]
    builder = functools.partial(build_model_and_algo, cfg.to_dict(), data.num_classes,
                                data.in_channels, data.image_size)
    model, algo = builder()
    model.to(device)
    notes = [warning] if warning else []
    if cfg.client_batch > 1:  # refused before a run folder is written
        from privfedcal.federation.vectorised import check_vectorisable, slow_on_device

        check_vectorisable(model, algo)
        slow = slow_on_device(model, device)
        if slow:
            notes.append(slow)
    local = LocalSpec(local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                      momentum=cfg.momentum, weight_decay=cfg.weight_decay, augment=cfg.augment,
                      seed=cfg.seed,
                      mixed_precision=choose_mixed_precision(model, device, cfg.precision))
    return Experiment(cfg, device, data, parts, counts, model, algo, builder, local, notes,
                      num_examples)


def build_experiment(cfg: RunConfig) -> Experiment:
    """The clients' (and the experimenter's) experiment: the data and the partition drawn
    from the data seed (``resolve_data_seed``; ``exp.cfg.data_seed`` holds it)."""
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition import PartitionSpec, class_counts, partition_dataset

    resolve_device(cfg.device)
    set_deterministic(cfg.deterministic)
    cfg = cfg.replace(data_seed=resolve_data_seed(cfg))
    data = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download)
    labels = data.y_train.numpy()
    spec = PartitionSpec(scheme=cfg.partition, num_clients=cfg.clients, alpha=cfg.alpha,
                         imbalance_factor=cfg.imbalance_factor,
                         shards_per_client=cfg.shards_per_client, min_size=cfg.min_size)
    parts_np = partition_dataset(data, spec, cfg.data_seed)
    counts = class_counts(labels, parts_np, data.num_classes)
    held = held_examples(labels, cfg)
    if int(counts.sum()) != held:  # the public count the server plans with must be exact
        raise RuntimeError(f"partition {cfg.partition} holds {int(counts.sum())} examples, "
                           f"not the {held} that held_examples declares")
    return _finish(cfg, data, parts_np, counts, held)


def server_dataset(data: Any) -> Any:
    """``data`` without its training samples: the test set, the classes, the image shape and
    the normalisation (public preprocessing constants) are all a server keeps."""
    empty = {"x_train": data.x_train[:0], "y_train": data.y_train[:0]}
    if data.domains_train is not None:
        empty["domains_train"] = data.domains_train[:0]
    if data.users_train is not None:  # the users, and so the user-to-client map, stay private
        empty["users_train"] = data.users_train[:0]
    return dataclasses.replace(data, **empty)


def build_server_experiment(cfg: RunConfig) -> Experiment:
    """The server's experiment (Flower ServerApp, attacks on a server view): model, method
    and test set, no partition (``parts`` and ``counts`` are None) and no training samples;
    ``num_examples`` is the public ``held_examples``. The data seed is neither read nor
    drawn. The dataset is read once for its test split and public metadata, and its
    training split is dropped before anything else runs."""
    from privfedcal.data.datasets import load_dataset

    resolve_device(cfg.device)
    set_deterministic(cfg.deterministic)
    data = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download)
    held = held_examples(data.y_train.numpy(), cfg)
    return _finish(cfg, server_dataset(data), None, None, held)
