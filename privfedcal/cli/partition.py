"""``privfedcal partition``: show how a dataset splits over clients (table, heatmap, JSON).

The partition is the one ``privfedcal train`` uses for the same settings: the defaults are
``train``'s (RunConfig's, e.g. ``--imbalance-factor 10``, used by ``--partition longtail``
only) and ``--config`` takes the same TOML file or a run's ``config.json`` (its training
settings are ignored here). Samples the long-tail shaping drops belong to no client. An
earlier partition in ``--out`` is kept unless ``--overwrite`` (``output.py``).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from privfedcal.cli.output import all_or_nothing, check_fresh
from privfedcal.cli.train import command_options, setting_options
from privfedcal.config import RunConfig
from privfedcal.data.partition import PartitionSpec
from privfedcal.settings import settings_of

Opt = typer.Option
_TABLE_MAX_CLASSES = 20  # wider tables are summarised; partition.json has every count
#: flags of this command that are RunConfig fields (the rest of a --config file is ignored)
PARTITION_KEYS = ("dataset", "data_root", "download", "clients", "partition", "alpha",
                  "imbalance_factor", "shards_per_client", "min_size", "seed", "data_seed")


def _partition_options(
    config: Annotated[Path | None, Opt(help="The TOML file or run config.json train takes; flags override it.", rich_help_panel="Output")] = None,
    out: Annotated[Path, Opt(help="Output folder for partition.png and partition.json.", rich_help_panel="Output")] = Path("runs/partition"),
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier partition.png and partition.json in --out.", rich_help_panel="Output")] = False,
) -> None:
    """``partition``'s options that are not settings of a run."""


def partition(**given: Any) -> None:
    """Partition a training set over clients; print per-client class counts, write a heatmap."""
    from privfedcal.config import load_toml
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition import class_counts, partition_indices
    from privfedcal.data.plots import plot_partition

    config, out, overwrite = given.pop("config"), given.pop("out"), given.pop("overwrite")
    files = ("partition.png", "partition.json")
    check_fresh(out, files, overwrite=overwrite, what="a partition")  # before the data load
    given = {k: v for k, v in given.items() if v is not None}
    merged = {k: v for k, v in (load_toml(config) if config else {}).items()
              if k in PARTITION_KEYS}
    cfg = RunConfig.from_dict({**merged, **given})
    spec = PartitionSpec(scheme=cfg.partition, num_clients=cfg.clients, alpha=cfg.alpha,
                         imbalance_factor=cfg.imbalance_factor,
                         shards_per_client=cfg.shards_per_client, min_size=cfg.min_size)
    # the seed the partition is drawn from: --data-seed (a run's config.json records it),
    # else --seed, as a run without a protection draws it
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    data = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download)
    labels = data.y_train.numpy()
    domains = data.domains_train.numpy() if data.domains_train is not None else None
    parts = partition_indices(labels, spec, seed, domains=domains)
    counts = class_counts(labels, parts, data.num_classes)
    title = f"{data.name}: {spec.scheme}, K={spec.num_clients}, seed={seed}"
    summary = {
        "dataset": data.name, "partition": spec.scheme, "clients": spec.num_clients,
        "alpha": spec.alpha, "imbalance_factor": spec.imbalance_factor,
        "shards_per_client": spec.shards_per_client, "min_size": spec.min_size, "seed": seed,
        "classes": data.classes, "num_train": data.num_train,
        "num_assigned": int(counts.sum()), "sizes": counts.sum(axis=1).tolist(),
        "class_totals": counts.sum(axis=0).tolist(), "counts": counts.tolist(),
    }
    if data.domain_names is not None and spec.scheme == "domains":
        summary["client_domains"] = data.domain_names
    with all_or_nothing(out, files) as paths:  # both files or neither
        plot_partition(counts, paths["partition.png"], classes=data.classes, title=title)
        paths["partition.json"].write_text(json.dumps(summary, indent=2) + "\n")
    _print_table(counts, data.classes, title)
    print(f"wrote {out / 'partition.png'} and {out / 'partition.json'}")


def _print_table(counts: np.ndarray, classes: list[str], title: str) -> None:
    from rich.table import Table

    from privfedcal.cli.console import print_table

    table = Table(title=title)
    table.add_column("client", justify="right")
    sizes = counts.sum(axis=1)
    if counts.shape[1] <= _TABLE_MAX_CLASSES:
        for name in classes:
            table.add_column(name, justify="right")
        table.add_column("total", justify="right", style="bold")
        for k, row in enumerate(counts):
            table.add_row(str(k), *(str(int(v)) for v in row), str(int(sizes[k])))
        table.add_row("total", *(str(int(v)) for v in counts.sum(axis=0)), str(int(sizes.sum())),
                      style="bold")
    else:  # too many classes for columns: summarise each client
        for name in ("total", "classes held", "most common class", "its share"):
            table.add_column(name, justify="right")
        for k, row in enumerate(counts):
            top = int(row.argmax())
            share = row[top] / sizes[k] if sizes[k] else 0.0
            table.add_row(str(k), str(int(sizes[k])), str(int((row > 0).sum())),
                          class_label(classes, top), f"{share:.0%}")
        table.add_row("total", str(int(sizes.sum())), str(int((counts.sum(0) > 0).sum())), "", "",
                      style="bold")
    print_table(table)


def class_label(classes: list[str], index: int) -> str:
    """A class as 'name (#id)', or '#id' when the name is the id itself, so that it never
    reads like a sample count."""
    name = str(classes[index]) if index < len(classes) else str(index)
    return f"#{index}" if name == str(index) else f"{name} (#{index})"


# The settings' options are train's (privfedcal/settings.py), so are their defaults.
partition.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    setting_options(s for s in settings_of(RunConfig, "run") if s.name in PARTITION_KEYS)
    + command_options(_partition_options))


def register(app: typer.Typer) -> None:
    app.command("partition")(partition)
