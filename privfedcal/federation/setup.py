"""Build an experiment (data, partition, model, method) from a run's narrow options.

The layers above (``privfedcal/experiment.py``) resolve a ``RunConfig``: the settings left
None filled per model and dataset once the data is loaded, the data seed once the
protections are known, and build from it, once, the narrow options this floor and those
below take (privfedcal/settings/floors.py): the data options, the local-training spec
(``exp.spec``), the engine, privacy and loop options. Nothing here reads the whole config;
the experiment carries its resolved settings only as the record ``config.json`` holds
(``exp.record``, written by ``runfolder.write_run_files``).

Two seeds (docs/threat-model.md): the protocol seed ``--seed`` is public (the server holds
it: it picks clients and initialises models); the data seed draws the partition, which only
the clients hold. The server's experiment (``assemble`` with no partition) holds the model,
the test set and public sizes, never the training samples or the partition.
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
from privfedcal.federation.local import choose_mixed_precision, set_deterministic
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import make_generator
from privfedcal.settings.floors import (
    DataOptions,
    LocalSpec,
    LoopOptions,
    PrivacyOptions,
    RunOptions,
)
from privfedcal.settings.messages import SettingError
from privfedcal.settings.run_config import MODEL_MIN_INPUT
from privfedcal.settings.sections import EngineSettings, PrivacySettings


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SettingError("{device=} requested but no CUDA device is available", device="cuda")
    return torch.device(name)


def build_model_and_algo(model_name: str, training: LocalSpec, num_classes: int,
                         in_channels: int, image_size: int
                         ) -> tuple[FeatureClassifier, Algorithm]:
    """The same model + method objects in the server and in every worker (picklable)."""
    from privfedcal.models import create_model

    algo = create_algorithm(training.method, num_classes=num_classes, **training.method_params)
    seed = training.training.seed
    model = create_model(model_name, num_classes=num_classes, in_channels=in_channels,
                         image_size=image_size, generator=make_generator(seed, 0, 0, 7))
    if training.privacy.dp_train:  # BatchNorm has no per-sample gradient: GroupNorm for the whole run
        from privfedcal.privacy.dpsgd import prepare_model

        model = prepare_model(model)
    algo.configure_model(model, make_generator(seed, 0, 0, 8))
    return model, algo


def partition_is_secret(privacy: PrivacySettings) -> bool:
    """Whether the run's protections claim something the server could read off a public
    partition: any DP, secure aggregation or hidden counts. A server that can redraw the
    partition of a public dataset knows every client's examples, so their partition must
    come from a seed it does not hold. ``--insecure-seeded-noise`` declares the run insecure
    against anyone who knows the seed: its partition follows the seed too."""
    return privacy.protected and not privacy.insecure_seeded_noise


def resolve_data_seed(data: DataOptions, privacy: PrivacySettings) -> int:
    """The seed of the partition: ``--data-seed`` when given; else, under a protection
    (``partition_is_secret``), 63 bits of OS entropy (recorded on the experimenter's side of
    the run folder only, so ``--config RUN/config.json`` redraws the same partition); else
    ``--seed`` (a plain run's partition is public and reproducible)."""
    if data.data_seed is not None:
        return data.data_seed
    if partition_is_secret(privacy):
        return secrets.randbits(63)
    return data.seed


#: the settings that decide which examples a client holds (besides the secret data seed)
PARTITION_SETTINGS = ("dataset", "partition", "clients", "alpha", "imbalance_factor",
                      "shards_per_client", "min_size")


def partition_settings_digest(data: DataOptions) -> str:
    """A digest of the public data settings, by which a Flower node shows the server it
    partitions as the run says (the server cannot redraw the partition to check)."""
    import hashlib
    import json

    text = json.dumps({k: getattr(data, k) for k in PARTITION_SETTINGS}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def held_examples(labels: np.ndarray, data: DataOptions) -> int:
    """How many training examples the clients hold together: a function of the public
    dataset and partition scheme, not of the draw (long-tail shaping keeps a fixed number
    per class; every other scheme deals out every example). The server plans DP and secure
    aggregation with it, as the clients do, without the partition."""
    from privfedcal.data.partition import longtail_counts

    if data.partition in ("longtail", "longtail-dirichlet"):
        return int(longtail_counts(np.bincount(labels), data.imbalance_factor).sum())
    return int(len(labels))


@dataclass
class Experiment:
    """One run's data, partition, model and method, with the narrow options every floor
    below the assembly reads (privfedcal/settings/floors.py)."""

    device: torch.device
    data: Any  # privfedcal.data.datasets.Dataset, on device
    parts: list[Tensor] | None  # per-client index tensors on device; None on the server
    counts: np.ndarray | None  # (K, C) class counts; None on the server
    model: FeatureClassifier
    algo: Algorithm
    #: the model and method again (worker processes); how a client trains. Both None on
    #: the Flower plugin's server, which trains no client
    builder: functools.partial
    spec: LocalSpec
    data_options: DataOptions
    engine: EngineSettings
    privacy: PrivacyOptions
    loop: LoopOptions
    model_name: str
    #: the resolved settings as ``config.json`` records them (``RunConfig.to_dict``): written,
    #: never read below the assembly (privfedcal/experiment.py ``config_of`` reads them back)
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: training examples the clients hold together (public: ``held_examples``)
    num_examples: int = 0

    def partition_record(self) -> dict[str, Any]:
        """What ``partition.json`` holds: the spec, per-client class counts and indices."""
        from privfedcal.data.partition import client_sources

        o, d = self.data_options, self.data
        if self.parts is None or self.counts is None:
            raise ValueError("the server's experiment holds no partition")
        record = {
            "dataset": d.name, "partition": o.partition, "clients": o.clients,
            "alpha": o.alpha, "imbalance_factor": o.imbalance_factor,
            "shards_per_client": o.shards_per_client, "min_size": o.min_size,
            "seed": o.seed, "data_seed": o.data_seed, "classes": d.classes, "num_train": d.num_train,
            "num_assigned": int(self.counts.sum()), "sizes": self.counts.sum(axis=1).tolist(),
            "class_totals": self.counts.sum(axis=0).tolist(), "counts": self.counts.tolist(),
            "indices": [p.tolist() for p in self.parts],
        }
        record.update(client_sources(d, o.partition))  # private, as the indices
        return record


def fit_warning(model: str, dataset: str, image_size: int) -> str | None:
    """A warning when ``model`` is built for larger inputs than the dataset's images."""
    need = MODEL_MIN_INPUT.get(model)
    if need is None or image_size >= need:
        return None
    return (f"model {model} is built for images of at least {need}x{need} pixels but "
            f"{dataset} has {image_size}x{image_size} images: it may train no better than "
            f"chance (the dataset's default model fits)")


def start(engine: EngineSettings) -> torch.device:
    """The run's device (refused at once when unavailable), with ``--deterministic``'s
    kernels set before anything computes."""
    device = resolve_device(engine.device)
    set_deterministic(engine.deterministic)
    return device


def assemble(options: RunOptions, data: Any, parts_np: list[np.ndarray] | None,
             counts: np.ndarray | None, num_examples: int, *,
             record: dict[str, Any]) -> Experiment:
    """The experiment of ``options`` (resolved: every per-model default filled, the model
    named) on ``data``: the data and the partition on the run's device, the model and
    method; ``parts_np`` None: the server's (no partition, ``data`` without its training
    samples, ``server_dataset``). ``record``: the settings ``config.json`` records."""
    model_name = record["model"]
    device = resolve_device(options.engine.device)
    warning = fit_warning(model_name, options.data.dataset, data.image_size)
    data = data.to(device)
    parts = None if parts_np is None else [
        torch.as_tensor(p, dtype=torch.long, device=device) for p in parts_np]
    builder = functools.partial(build_model_and_algo, model_name, options.training,
                                data.num_classes, data.in_channels, data.image_size)
    model, algo = builder()
    model.to(device)
    notes = [warning] if warning else []
    if options.engine.client_batch > 1:  # refused before a run folder is written
        from privfedcal.federation.vectorised import check_vectorisable, slow_on_device

        check_vectorisable(model, algo)
        slow = slow_on_device(model, device)
        if slow:
            notes.append(slow)
    training = dataclasses.replace(options.training, mixed_precision=choose_mixed_precision(
        model, device, options.engine.precision))
    return Experiment(device, data, parts, counts, model, algo, builder, training,
                      options.data, options.engine, options.privacy, options.loop, model_name,
                      dict(record), notes, num_examples)


def load_data(options: DataOptions) -> Any:
    """The dataset ``options`` name (``data.datasets.load_dataset``)."""
    from privfedcal.data.datasets import load_dataset

    return load_dataset(options.dataset, options.data_root, download=options.download)


def draw_partition(data: Any, options: DataOptions
                   ) -> tuple[list[np.ndarray], np.ndarray, int]:
    """(each client's sample indices, the (K, C) class counts, the examples held) of the
    partition ``options`` describe, drawn from its data seed (resolved)."""
    from privfedcal.data.partition import PartitionSpec, class_counts, partition_dataset

    if options.data_seed is None:
        raise ValueError("resolve the data seed first (resolve_data_seed)")
    labels = data.y_train.numpy()
    spec = PartitionSpec(scheme=options.partition, num_clients=options.clients,
                         alpha=options.alpha, imbalance_factor=options.imbalance_factor,
                         shards_per_client=options.shards_per_client, min_size=options.min_size)
    parts_np = partition_dataset(data, spec, options.data_seed)
    counts = class_counts(labels, parts_np, data.num_classes)
    held = held_examples(labels, options)
    if int(counts.sum()) != held:  # the public count the server plans with must be exact
        raise RuntimeError(f"partition {options.partition} holds {int(counts.sum())} "
                           f"examples, not the {held} that held_examples declares")
    return parts_np, counts, held


def server_dataset(data: Any) -> Any:
    """``data`` without its training samples: the test set, the classes, the image shape and
    the normalisation (public preprocessing constants) are all a server keeps."""
    empty = {"x_train": data.x_train[:0], "y_train": data.y_train[:0]}
    if data.domains_train is not None:
        empty["domains_train"] = data.domains_train[:0]
    if data.users_train is not None:  # the users, and so the user-to-client map, stay private
        empty["users_train"] = data.users_train[:0]
    return dataclasses.replace(data, **empty)
