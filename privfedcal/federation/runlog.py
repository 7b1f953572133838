"""What a run logs besides ``metrics.jsonl`` (one line per evaluated round) and the checkpoint:

- ``metrics.csv``: one row per round, evaluated or not (``train_loss`` always; ``accuracy``,
  ``loss`` and ``worst_class_accuracy`` empty on rounds that were not evaluated), for
  spreadsheets and pandas;
- ``clients.jsonl``: per round, the clients sampled and each one's sample count and mean
  local training loss (an experimenter's record at the top of the run folder, not in the
  server's view ``server/``; a Flower server, which holds no partition, writes no counts);
- optionally TensorBoard event files under ``tensorboard/`` (``--log tensorboard``, the
  ``tensorboard`` extra), flushed every round so ``tensorboard --logdir RUN_DIR`` shows a run
  while it goes.

On resume the CSV is rewritten from the checkpoint's history and ``clients.jsonl`` cut back
to the checkpoint's round, so no row is duplicated.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfedcal.errors import UsageError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

CSV_COLUMNS = ("round", "train_loss", "accuracy", "loss", "worst_class_accuracy", "clients",
               "seconds")
LOG_TARGETS = ("tensorboard",)
_TB_MISSING = ("--log tensorboard needs the tensorboard package: "
               "pip install 'privfedcal[tensorboard]'")


def parse_log(text: str | None) -> tuple[str, ...]:
    """``--log`` values: a comma-separated subset of LOG_TARGETS (empty = files only)."""
    out = tuple(t.strip().lower() for t in (text or "").split(",") if t.strip())
    for t in out:
        if t not in LOG_TARGETS:
            raise UsageError(f"--log takes {', '.join(LOG_TARGETS)}, got {t!r}")
    if "tensorboard" in out and importlib.util.find_spec("tensorboard") is None:
        raise UsageError(_TB_MISSING)
    return out


def _worst(per_class: Sequence[float | None] | None) -> float | None:
    vals = [v for v in per_class or [] if v is not None]
    return min(vals) if vals else None


def csv_row(record: dict[str, Any]) -> dict[str, Any]:
    return {"round": record["round"], "train_loss": record.get("train_loss"),
            "accuracy": record.get("accuracy"), "loss": record.get("loss"),
            "worst_class_accuracy": _worst(record.get("per_class_accuracy")),
            "clients": record.get("clients"), "seconds": record.get("seconds")}


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


class RunLogger:
    """Writes the per-round logs of one run folder (see the module docstring)."""

    def __init__(self, run_dir: Path, exp: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.writer: SummaryWriter | None = None
        self._clients: dict[int, int] = {}
        if exp is not None and exp.parts is not None:  # a Flower server holds no partition
            self._clients = {c: int(p.numel()) for c, p in enumerate(exp.parts)}

    def enable(self, targets: Sequence[str]) -> None:
        """Turn on optional writers (``tensorboard``); a missing package is a usage error."""
        if "tensorboard" in targets and self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError(_TB_MISSING) from None
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def round(self, record: dict[str, Any], selected: Sequence[int],
              losses: Sequence[float | None]) -> None:
        """Log one finished round: ``record`` is the round's history entry, ``losses`` the
        sampled clients' mean local losses in the order of ``selected`` (None under DP-SGD:
        the loss never leaves a client, and the cells stay empty)."""
        row = csv_row({**record, "clients": len(selected)})
        path = self.run_dir / "metrics.csv"
        new = not path.exists()
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            if new:
                w.writeheader()
            w.writerow({k: _cell(v) for k, v in row.items()})
        clients = [{"client": int(c), "samples": self._clients.get(int(c)),
                    "train_loss": None if loss is None else float(loss)}
                   for c, loss in zip(selected, losses, strict=True)]
        with (self.run_dir / "clients.jsonl").open("a") as f:
            f.write(json.dumps({"round": record["round"], "sampled": [int(c) for c in selected],
                                "clients": clients}) + "\n")
        if self.writer is not None:
            step = int(record["round"])
            if record["train_loss"] is not None:
                self.writer.add_scalar("train/loss", record["train_loss"], step)
            for c in clients:
                if c["train_loss"] is not None:
                    self.writer.add_scalar(f"clients/train_loss/{c['client']:03d}",
                                           c["train_loss"], step)
            for key in ("accuracy", "loss", "worst_class_accuracy"):
                if row.get(key) is not None:
                    self.writer.add_scalar(f"test/{key}", row[key], step)
            self.writer.add_scalar("train/clients_sampled", len(selected), step)
            self.writer.flush()

    def restore(self, history: Sequence[dict[str, Any]]) -> None:
        """Rewrite the logs to match a checkpoint's history (resume)."""
        last = max((int(h["round"]) for h in history), default=0)
        with (self.run_dir / "metrics.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            w.writeheader()
            for h in history:
                w.writerow({k: _cell(v) for k, v in csv_row(h).items()})
        path = self.run_dir / "clients.jsonl"
        if path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["round"] <= last]
            path.write_text("".join(line + "\n" for line in keep))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_metrics_csv(path: Path) -> list[dict[str, float | None]]:
    """Rows of ``metrics.csv`` with numbers parsed and empty cells as None."""
    out = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            out.append({k: (float(v) if v not in ("", None) else None) for k, v in row.items()})
    return out


__all__ = ["RunLogger", "parse_log", "read_metrics_csv", "CSV_COLUMNS"]
