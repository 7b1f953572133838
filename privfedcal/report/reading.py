"""Reading a run folder's JSON files: a missing file is ``None``, a broken one a one-line
``UsageError``, a folder without ``summary.json`` (a run that has not finished) refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from privfedcal.errors import UsageError


def load_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None


def load_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary, config) of a finished run folder; a clear UsageError otherwise."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a folder")
    summary = load_json(run_dir / "summary.json")
    if summary is None:
        hint = " (the run has not finished: see metrics.jsonl)" if (
            run_dir / "config.json").exists() else ""
        raise UsageError(f"{run_dir} has no summary.json{hint}")
    return summary, load_json(run_dir / "config.json") or {}
