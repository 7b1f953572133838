"""Each party's journal of the DP releases it has made, so that a release happens once.

A noised release that has left a client must never be made again with fresh noise: the
server would hold two independent draws of the same statistic, worth more epsilon than the
accountant charged once. A run stopped between a release and its round's checkpoint redoes
that round on resume, so every party writes what it releases here, flushed to disk
(``fsync``) BEFORE the release leaves it, and a redone release re-sends the journaled value
instead of a fresh draw: the server then sees the same value again, which is worth nothing
new, and the charge re-applied by the redo (the ledgers and the accountant, rolled back to
the checkpoint) ends where the first attempt would have.

Entries are keyed by (round, release label, party): a client's noised payload (after noise,
before encryption), its DP-SGD or DP-FedAvg update as sent, the key holder's decrypted sum
(party ``keyholder-<contributors>``) or the server's noisy sum under central DP-FedAvg
(party ``server``), each with the charge it stands for (noise multiplier, sample rate,
steps). The simulator plays every party and keeps the journal at ``RUN/journal/`` (the
experimenter's side of the run folder, never ``server/``); in a deployment each party keeps
its own. Entries of rounds at or before a checkpoint can never be redone and are pruned
when it is written (``prune_through``), so the journal holds about one round.

The guarantee holds while the journal survives the stop (it is on disk before the release
leaves); a party whose journal is lost redraws, and the release is then charged twice by
``transcript_epsilon`` from the server's record, not by the run's accountant.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from privfedcal.privacy.removals import remove_later

#: the journal's folder in a run folder (beside ``checkpoint/``: the experimenter's side)
JOURNAL_DIR = "journal"
#: the party name of the key holder's decrypted sums and of the server's own noise
KEY_HOLDER = "keyholder"
SERVER = "server"
_META = "privfedcal.journal"
_NAME = re.compile(r"^r(\d+)-")


def contributors_party(contributors: list[int]) -> str:
    """The key holder's party name for a sum of ``contributors``: a sum over other
    contributors is another release, journaled apart."""
    digest = hashlib.sha1(json.dumps(sorted(int(c) for c in contributors)).encode())
    return f"{KEY_HOLDER}-{digest.hexdigest()[:12]}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "~", text)


class ReleaseJournal:
    """Releases made, by (round, label, party); ``directory=None`` keeps them in memory
    (a run without a folder: nothing survives a stop, so nothing is redone either)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._memory: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self.reused = 0  # releases re-sent from the journal in this process
        #: called before a release is journaled: the simulator waits there for the
        #: checkpoint it is still writing, so a release of round r+1 never leaves before
        #: checkpoint r is in place (or its failure has stopped the run, which then resumes
        #: from r-1 and holds no release of r+1 to redo)
        self.before_put: Callable[[], None] | None = None

    @staticmethod
    def _name(round_: int, label: str, party: int | str) -> str:
        return f"r{int(round_):05d}-{_safe(label)}-{_safe(str(party))}.safetensors"

    def get(self, round_: int, label: str, party: int | str
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The journaled release and its record (charge and context), or None."""
        name = self._name(round_, label, party)
        if self.directory is None:
            return self._memory.get(name)
        path = self.directory / name
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(_META, "{}"))
        return load_file(str(path)), meta

    def put(self, round_: int, label: str, party: int | str,
            tensors: dict[str, torch.Tensor], **record: Any) -> None:
        """Journal a release, on disk and flushed before this returns: written to a
        temporary file, fsynced, renamed over, and the folder fsynced."""
        if self.before_put is not None:
            self.before_put()
        name = self._name(round_, label, party)
        copy = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
        meta = {"round": int(round_), "label": label, "party": party, **record}
        if self.directory is None:
            self._memory[name] = (copy, meta)
            return
        self.directory.mkdir(parents=True, exist_ok=True)  # made on the first release
        tmp = self.directory / (name + ".tmp")
        save_file(copy, str(tmp), metadata={_META: json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def once(self, round_: int, label: str, party: int | str,
             tensors: dict[str, torch.Tensor], **record: Any) -> dict[str, torch.Tensor]:
        """The release to send: the journaled one if this party made it before (counted in
        ``reused``), else ``tensors``, journaled first."""
        kept = self.get(round_, label, party)
        if kept is not None:
            self.reused += 1
            like = next(iter(tensors.values()), None)
            device = like.device if like is not None else torch.device("cpu")
            return {k: v.to(device) for k, v in kept[0].items()}
        self.put(round_, label, party, tensors, **record)
        return tensors

    def rounds(self) -> list[int]:
        """The rounds that have journaled releases."""
        names = (list(self._memory) if self.directory is None
                 else [p.name for p in self.directory.glob("r*.safetensors")])
        return sorted({_round_of(n) for n in names if _NAME.match(n)})

    def prune_through(self, round_: int, *, background: bool = False) -> None:
        """Forget the releases of rounds ``<= round_`` (a checkpoint of ``round_`` is on
        disk: they are never redone). ``background``: the files, listed now, are removed on
        a thread (removing a file fsynced moments ago waits for the disk, about 3 ms here;
        privacy/removals.py): a release journaled later is never among them, and a stop
        before they are gone leaves releases of checkpointed rounds, which are never asked
        for again."""
        if self.directory is None:
            for name in [n for n in self._memory if _round_of(n) <= round_]:
                del self._memory[name]
            return
        if not self.directory.is_dir():
            return
        paths = [p for p in self.directory.glob("r*.safetensors*") if _round_of(p.name) <= round_]
        if background:
            remove_later(paths)
            return
        for path in paths:
            path.unlink(missing_ok=True)


def _round_of(name: str) -> int:
    """The round of a journal file's name (a name not of the journal: never pruned)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else 2**62


def charge_of(dp: Any, label: str) -> dict[str, Any] | None:
    """The charge a release of ``label`` stands for under ``dp`` (a ``DPAccounting``):
    noise multiplier, sample rate and steps; None where ``label`` is not a DP release."""
    if dp is None or label not in dp.sigmas:
        return None
    return {"noise_multiplier": float(dp.sigmas[label]), "sample_rate": float(dp.rates[label]),
            "steps": int(dp.steps.get(label, 1))}


__all__ = ["JOURNAL_DIR", "KEY_HOLDER", "SERVER", "ReleaseJournal", "charge_of",
           "contributors_party"]
