"""Build an experiment (data, partition, model, method, calibrator) from a RunConfig."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from privfedcal.algorithms import create_algorithm
from privfedcal.algorithms.base import Algorithm
from privfedcal.config import RunConfig
from privfedcal.errors import UsageError
from privfedcal.federation.local import LocalSpec, make_generator
from privfedcal.models.base import FeatureClassifier


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

    @property
    def model_name(self) -> str:
        from privfedcal.data.datasets import default_model_for

        return self.cfg.model or default_model_for(self.data)


def build_experiment(cfg: RunConfig) -> Experiment:
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition import PartitionSpec, class_counts, partition_indices

    device = resolve_device(cfg.device)
    if cfg.workers > 1 and device.type != "cpu":
        raise UsageError("--workers > 1 runs CPU processes; use --device cpu (one GPU is "
                         "best used by one process)")
    data = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download)
    labels = data.y_train.numpy()
    domains = data.domains_train.numpy() if data.domains_train is not None else None
    spec = PartitionSpec(scheme=cfg.partition, num_clients=cfg.clients, alpha=cfg.alpha,
                         imbalance_factor=cfg.imbalance_factor,
                         shards_per_client=cfg.shards_per_client, min_size=cfg.min_size)
    parts_np = partition_indices(labels, spec, cfg.seed, domains=domains)
    counts = class_counts(labels, parts_np, data.num_classes)
    data = data.to(device)
    parts = [torch.as_tensor(p, dtype=torch.long, device=device) for p in parts_np]
    builder = functools.partial(build_model_and_algo, cfg.to_dict(), data.num_classes,
                                data.in_channels, data.image_size)
    model, algo = builder()
    model.to(device)
    augment = data.augment if cfg.augment is None else cfg.augment
    local = LocalSpec(local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                      momentum=cfg.momentum, weight_decay=cfg.weight_decay, augment=augment,
                      seed=cfg.seed)
    return Experiment(cfg, device, data, parts, counts, model, algo, builder, local)
