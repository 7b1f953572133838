"""``partition`` as a job: the partition ``train`` draws for the same settings, its counts,
summary and heatmap (``data/partition.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfedcal.api.arguments import coerce
from privfedcal.errors import UsageError
from privfedcal.jobs.job_surface import job
from privfedcal.report.output_folder import all_or_nothing, check_fresh
from privfedcal.settings.run_config import RunConfig

if TYPE_CHECKING:
    import numpy as np

PARTITION_FILES = ("partition.png", "partition.json")
#: the RunConfig fields a partition depends on (the rest of a settings file is ignored)
PARTITION_KEYS = ("dataset", "data_root", "download", "clients", "partition", "alpha",
                  "imbalance_factor", "shards_per_client", "min_size", "seed", "data_seed")



@dataclass(frozen=True, eq=False)  # arrays have no truth value: compare the fields
class Partition:
    """``partition``'s result: ``counts[k, c]``, the samples of class c client k holds;
    ``indices[k]``, client k's training-set indices; ``summary``, ``partition.json``'s
    dict; and the files written (empty: none)."""

    counts: np.ndarray
    indices: list[np.ndarray]
    classes: list[str]
    title: str
    summary: dict[str, Any]
    files: tuple[Path, ...] = ()

    @property
    def sizes(self) -> list[int]:
        """Samples each client holds."""
        return [int(n) for n in self.counts.sum(axis=1)]


def partition_for_cli(config: RunConfig | Mapping[str, Any] | str | Path | None,
                      settings: Mapping[str, Any], out: Path | None = None,
                      overwrite: bool = False) -> Partition:
    """``privfedcal partition``: the partition ``train`` draws for the same settings (the
    ``PARTITION_KEYS`` of ``config``, ``settings`` over them). With ``out``, the heatmap and
    ``partition.json`` are written there (an earlier partition is kept unless ``overwrite``;
    both files or neither)."""
    import json

    from privfedcal.data import partition as partitioning
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition_plots import plot_partition
    from privfedcal.data.sizes import size_distribution
    from privfedcal.settings.run_config import load_toml

    if out is not None:
        check_fresh(out, PARTITION_FILES, overwrite=overwrite, what="a partition")  # first
    if isinstance(config, RunConfig):
        base = config.to_dict()
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        base = load_toml(config) if config else {}
    merged = {k: v for k, v in base.items() if k in PARTITION_KEYS}
    cfg = RunConfig.from_dict({**merged, **{k: v for k, v in settings.items() if v is not None}})
    spec = partitioning.PartitionSpec(
        scheme=cfg.data.partition, num_clients=cfg.data.clients, alpha=cfg.data.alpha,
        imbalance_factor=cfg.data.imbalance_factor, shards_per_client=cfg.data.shards_per_client,
        min_size=cfg.data.min_size)
    # drawn from --data-seed (a run's config.json records it), else --seed, as a run
    # without a protection draws it
    seed = cfg.training.seed if cfg.training.data_seed is None else cfg.training.data_seed
    data = load_dataset(cfg.data.dataset, cfg.data.data_root, download=cfg.data.download)
    # with the data's domain or user ids (the domains and natural schemes read them)
    parts = partitioning.partition_dataset(data, spec, seed)
    counts = partitioning.class_counts(data.y_train.numpy(), parts, data.num_classes)
    title = f"{data.name}: {spec.scheme}, K={spec.num_clients}, seed={seed}"
    summary = {
        "dataset": data.name, "partition": spec.scheme, "clients": spec.num_clients,
        "alpha": spec.alpha, "imbalance_factor": spec.imbalance_factor,
        "shards_per_client": spec.shards_per_client, "min_size": spec.min_size, "seed": seed,
        "classes": data.classes, "num_train": data.num_train,
        "num_assigned": int(counts.sum()), "sizes": counts.sum(axis=1).tolist(),
        "class_totals": counts.sum(axis=0).tolist(), "counts": counts.tolist(),
        "size_distribution": size_distribution(counts.sum(axis=1)),
        **partitioning.client_sources(data, spec.scheme),  # client_domains / client_users
    }
    result = Partition(counts, parts, list(data.classes), title, summary)
    if out is None:
        return result
    with all_or_nothing(out, PARTITION_FILES) as paths:  # both files or neither
        plot_partition(counts, paths["partition.png"], classes=data.classes, title=title)
        paths["partition.json"].write_text(json.dumps(summary, indent=2) + "\n")
    return Partition(counts, parts, list(data.classes), title, summary,
                     tuple(out / n for n in PARTITION_FILES))


@job
def partition(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
              out: str | Path | None = None, overwrite: bool = False,
              **settings: Any) -> Partition:
    """How a dataset splits over clients, as ``privfedcal partition``: the partition
    ``train`` draws for the same settings. ``config`` (a ``RunConfig``, a mapping, a TOML
    file or a run's ``config.json``) gives the settings, ``settings`` override them; only
    ``dataset``, ``data_root``, ``download``, ``clients``, ``partition``, ``alpha``,
    ``imbalance_factor``, ``shards_per_client``, ``min_size``, ``seed`` and ``data_seed``
    count (``config``'s others are ignored; another keyword is refused). Writes
    ``partition.png`` and ``partition.json`` into ``out`` only when ``out`` is given (an
    earlier partition there is kept unless ``overwrite=True``)."""
    from privfedcal.settings.catalogue import settings_of

    unknown = sorted(set(settings) - set(PARTITION_KEYS))
    if unknown:
        raise UsageError(f"partition takes no setting {', '.join(unknown)}; it takes: "
                         f"{', '.join(PARTITION_KEYS)}")
    kinds = {s.name: s.type for s in settings_of(RunConfig, "run")}
    plain = {k: coerce(v, kinds.get(k), k) for k, v in settings.items()}
    return partition_for_cli(config, plain, None if out is None else Path(out), overwrite)
