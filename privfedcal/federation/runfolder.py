"""The run folder's settings record, written and read in this one place.

``config.json`` holds the resolved ``RunConfig`` plus record-only keys (``RUN_RECORD_KEYS``:
the library versions, and a Flower run's id) that are not settings; ``partition.json`` the
clients' class counts. Every writer (``train``, ``attack``'s quick run, ``audit``, the
Flower ServerApp) goes through the ``Simulator``, which calls ``write_run_files``; every
reader (resume, attacks, analysis) calls ``read_run_config``.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfedcal.config import RUN_RECORD_KEYS, RunConfig
from privfedcal.errors import UsageError

CONFIG_FILE = "config.json"
PARTITION_FILE = "partition.json"


def versions() -> dict[str, str]:
    """The versions a run records next to its settings."""
    import privfedcal

    return {"privfedcal": privfedcal.__version__, "torch": torch.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def write_config(run_dir: Path, cfg: RunConfig, **record: Any) -> Path:
    """``config.json``: the settings, the versions and ``record`` (keys of RUN_RECORD_KEYS)."""
    extra = sorted(set(record) - set(RUN_RECORD_KEYS))
    if extra:
        raise ValueError(f"not run-record keys: {', '.join(extra)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    path.write_text(json.dumps({**cfg.to_dict(), "versions": versions(), **record}, indent=2))
    return path


def write_run_files(run_dir: Path, exp: Any, **record: Any) -> None:
    """``config.json`` (the experiment's resolved settings) and ``partition.json``."""
    write_config(run_dir, exp.cfg, **record)
    (run_dir / PARTITION_FILE).write_text(json.dumps(exp.partition_record()) + "\n")


def read_run_config(run_dir: Path) -> RunConfig:
    """The settings of the run in ``run_dir`` (record-only keys dropped); a folder without a
    readable ``config.json`` is a usage error."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a run folder (no {CONFIG_FILE})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path} does not hold a settings object")
    for key in RUN_RECORD_KEYS:
        raw.pop(key, None)
    return RunConfig.from_dict(raw, where=str(path))
