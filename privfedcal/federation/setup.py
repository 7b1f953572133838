"""Build an experiment (data, partition, model, method, calibrator) from a RunConfig.

The experiment holds the *resolved* config: settings left None are filled per model and
dataset (``config.resolve_training_defaults``) once the data is loaded."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from privfedcal.algorithms import create_algorithm
from privfedcal.algorithms.base import Algorithm
from privfedcal.config import MODEL_MIN_INPUT, RunConfig, resolve_training_defaults
from privfedcal.errors import UsageError
from privfedcal.federation.local import (
    LocalSpec,
    choose_mixed_precision,
    set_deterministic,
)
from privfedcal.models.base import FeatureClassifier
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


@dataclass
class Experiment:
    cfg: RunConfig
    device: torch.device
    data: Any  # privfedcal.data.datasets.Dataset, on device
    parts: list[Tensor]  # per-client index tensors on device
    counts: np.ndarray  # (K, C) class counts
    model: FeatureClassifier
    algo: Algorithm
    builder: functools.partial
    spec: LocalSpec

    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def model_name(self) -> str:
        from privfedcal.data.datasets import default_model_for

        return self.cfg.model or default_model_for(self.data)

    def partition_record(self) -> dict[str, Any]:
        """What ``partition.json`` holds: the spec, per-client class counts and indices."""
        cfg, d = self.cfg, self.data
        record = {
            "dataset": d.name, "partition": cfg.partition, "clients": cfg.clients,
            "alpha": cfg.alpha, "imbalance_factor": cfg.imbalance_factor,
            "shards_per_client": cfg.shards_per_client, "min_size": cfg.min_size,
            "seed": cfg.seed, "classes": d.classes, "num_train": d.num_train,
            "num_assigned": int(self.counts.sum()), "sizes": self.counts.sum(axis=1).tolist(),
            "class_totals": self.counts.sum(axis=0).tolist(), "counts": self.counts.tolist(),
            "indices": [p.tolist() for p in self.parts],
        }
        if d.domain_names is not None and cfg.partition == "domains":
            record["client_domains"] = d.domain_names
        return record


def fit_warning(model: str, dataset: str, image_size: int) -> str | None:
    """A warning when ``model`` is built for larger inputs than the dataset's images."""
    need = MODEL_MIN_INPUT.get(model)
    if need is None or image_size >= need:
        return None
    return (f"model {model} is built for images of at least {need}x{need} pixels but "
            f"{dataset} has {image_size}x{image_size} images: it may train no better than "
            f"chance (the dataset's default model fits)")


def build_experiment(cfg: RunConfig) -> Experiment:
    from privfedcal.data.datasets import default_model_for, load_dataset
    from privfedcal.data.partition import PartitionSpec, class_counts, partition_indices

    device = resolve_device(cfg.device)
    set_deterministic(cfg.deterministic)
    data = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download)
    labels = data.y_train.numpy()
    domains = data.domains_train.numpy() if data.domains_train is not None else None
    spec = PartitionSpec(scheme=cfg.partition, num_clients=cfg.clients, alpha=cfg.alpha,
                         imbalance_factor=cfg.imbalance_factor,
                         shards_per_client=cfg.shards_per_client, min_size=cfg.min_size)
    parts_np = partition_indices(labels, spec, cfg.seed, domains=domains)
    counts = class_counts(labels, parts_np, data.num_classes)
    cfg = resolve_training_defaults(
        cfg, model=default_model_for(data), augment=data.augment)
    warning = fit_warning(cfg.model, cfg.dataset, data.image_size)
    data = data.to(device)
    parts = [torch.as_tensor(p, dtype=torch.long, device=device) for p in parts_np]
    builder = functools.partial(build_model_and_algo, cfg.to_dict(), data.num_classes,
                                data.in_channels, data.image_size)
    model, algo = builder()
    model.to(device)
    local = LocalSpec(local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                      momentum=cfg.momentum, weight_decay=cfg.weight_decay, augment=cfg.augment,
                      seed=cfg.seed,
                      mixed_precision=choose_mixed_precision(model, device, cfg.precision))
    return Experiment(cfg, device, data, parts, counts, model, algo, builder, local,
                      [warning] if warning else [])
