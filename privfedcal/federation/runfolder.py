"""The run folder's layout and settings record, written and read in this one place.

The folder is split along the privacy boundary (docs/usage.md, "The run folder"):

- ``server/``: the server's view, and all an attack reads: ``config.json`` (the public
  settings: every setting but the data seed), ``transcript/`` (what the server received),
  ``summary.json`` (what the server computed: accuracy on the public test set, the privacy
  plan and spend);
- ``private/``: what only the clients hold: ``partition.json`` (the data seed, every
  client's class counts and indices);
- the top level: the experimenter's records (``config.json`` with the data seed, so that
  ``--config RUN/config.json`` and ``--resume`` redraw the same partition; metrics,
  ``summary.json``, per-client logs, checkpoints, plots, reports).

``config.json`` holds the resolved settings (``RunConfig.to_dict()``, carried by the
experiment as ``exp.record``) plus record-only keys (``RUN_RECORD_KEYS``: the library
versions, and a Flower run's id) that are not settings. Every writer (``train``, ``attack``'s
quick run, ``audit``, the Flower ServerApp) goes through the ``Simulator``, which calls
``write_run_files``; every reader calls ``config.read_run_config``.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfedcal.settings.run_config import CONFIG_FILE, RUN_RECORD_KEYS

PARTITION_FILE = "partition.json"
SUMMARY_FILE = "summary.json"
SERVER_DIR = "server"  # the server's view
PRIVATE_DIR = "private"  # what only the clients hold
TRANSCRIPT_DIR = "transcript"


def server_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SERVER_DIR


def transcript_dir(run_dir: Path) -> Path:
    """Where a run records what the server saw: ``RUN/server/transcript``."""
    return server_dir(run_dir) / TRANSCRIPT_DIR


def server_view(path: Path) -> Path:
    """The folder holding the server's view for a path an attack is given: ``path/server``
    of a run folder, else ``path`` itself (a copy of a server view; or a run folder written
    before the split, whose ``transcript/`` sat at the top)."""
    path = Path(path)
    return server_dir(path) if (server_dir(path) / CONFIG_FILE).is_file() else path


def partition_file(run_dir: Path) -> Path | None:
    """The partition record of a run (``private/partition.json``; at the top level in runs
    written before the split), or None when the folder holds none (a server view, a Flower
    server's run folder)."""
    for path in (Path(run_dir) / PRIVATE_DIR / PARTITION_FILE, Path(run_dir) / PARTITION_FILE):
        if path.is_file():
            return path
    return None


def versions() -> dict[str, str]:
    """The versions a run records next to its settings."""
    import privfedcal

    return {"privfedcal": privfedcal.__version__, "torch": torch.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def write_config(run_dir: Path, settings: dict[str, Any], **record: Any) -> Path:
    """``config.json``: the settings (``RunConfig.to_dict()``), the versions and ``record``
    (keys of RUN_RECORD_KEYS)."""
    extra = sorted(set(record) - set(RUN_RECORD_KEYS))
    if extra:
        raise ValueError(f"not run-record keys: {', '.join(extra)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    path.write_text(json.dumps({**settings, "versions": versions(), **record}, indent=2))
    return path


def public_config(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings the server holds: all but the data seed."""
    return {**settings, "data_seed": None}


def write_run_files(run_dir: Path, exp: Any, **record: Any) -> None:
    """``config.json`` (the experiment's resolved settings, data seed included),
    ``server/config.json`` (the same without the data seed) and, where the experiment holds
    the partition (not on a Flower server), ``private/partition.json``."""
    write_config(run_dir, exp.record, **record)
    write_config(server_dir(run_dir), public_config(exp.record), **record)
    if exp.parts is not None:
        private = Path(run_dir) / PRIVATE_DIR
        private.mkdir(parents=True, exist_ok=True)
        (private / PARTITION_FILE).write_text(json.dumps(exp.partition_record()) + "\n")


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary.json`` at the top and in ``server/`` (the server computed all of it)."""
    text = json.dumps(summary, indent=2)
    for folder in (Path(run_dir), server_dir(run_dir)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SUMMARY_FILE).write_text(text)
    # the server's copy carries the view's one time, not the end of the run (transcript.py)
    view = server_dir(run_dir)
    if (view / CONFIG_FILE).is_file():
        epoch = (view / CONFIG_FILE).stat().st_mtime_ns
        for path in (view / SUMMARY_FILE, view):
            os.utime(path, ns=(epoch, epoch))
