"""``privfedcal partition``: show how a dataset splits over clients (table, heatmap, JSON).

The partition is the one ``privfedcal train`` uses for the same settings: the defaults are
``train``'s (RunConfig's, e.g. ``--imbalance-factor 10``, used by ``--partition longtail``
only) and ``--config`` takes the same TOML file or a run's ``config.json`` (its training
settings are ignored here). Samples the long-tail shaping drops belong to no client. An
earlier partition in ``--out`` is kept unless ``--overwrite`` (``report/output_folder.py``). The job is
``privfedcal.jobs.partition``; this parses and prints.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from privfedcal.cli.train_command import command_options, setting_options
from privfedcal.jobs import PARTITION_KEYS
from privfedcal.settings.catalogue import settings_of
from privfedcal.settings.run_config import RunConfig

Opt = typer.Option
_TABLE_MAX_CLASSES = 20  # wider tables are summarised; partition.json has every count
_TABLE_MAX_CLIENTS = 100  # more clients (a natural partition's users): the size summary only


def _partition_options(
    config: Annotated[Path | None, Opt(help="The TOML file or run config.json train takes; flags override it.", rich_help_panel="Output")] = None,
    out: Annotated[Path, Opt(help="Output folder for partition.png and partition.json.", rich_help_panel="Output")] = Path("runs/partition"),
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier partition.png and partition.json in --out.", rich_help_panel="Output")] = False,
) -> None:
    """``partition``'s options that are not settings of a run."""


# Its options, one per declared setting, are assembled when click builds the command (below);
# cli/command_signatures.py writes them out as a plain signature.
def partition(**given: Any) -> None:
    """Partition a training set over clients; print per-client class counts, write a heatmap."""
    from privfedcal import jobs
    from privfedcal.data.sizes import size_lines

    config, out, overwrite = given.pop("config"), given.pop("out"), given.pop("overwrite")
    result = jobs.partition_for_cli(config, given, out, overwrite)
    if len(result.counts) <= _TABLE_MAX_CLIENTS:
        _print_table(result.counts, result.classes, result.title)
    else:  # one row per client no longer reads; partition.json has every count
        print(result.title)
    print("\n".join(size_lines(result.summary["size_distribution"])))
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


# The settings' options are train's (privfedcal/settings/catalogue.py), so are their defaults.
partition.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    setting_options(s for s in settings_of(RunConfig, "run") if s.name in PARTITION_KEYS)
    + command_options(_partition_options))


def register(app: typer.Typer) -> None:
    app.command("partition")(partition)
