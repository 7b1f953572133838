"""What the server observed, release by release, saved in the run folder for the attacks.

Unprotected uploads are recorded per client (that is what an honest-but-curious server
sees); protected ones as per-client ciphertext sizes plus the decrypted aggregate only.
Model updates are recorded too (``record_round`` / ``record_model_updates``): once per round
the global state sent and the participants, then every participant's full local state with
the aggregation weight the server used, its size on the wire and the public local recipe.
Files: ``transcript/index.json`` (one entry per release) and one safetensors file per batch
of records (a round's global state and updates; an entry names its file and its ``key`` in
it: privacy/transcript_files.py). Disk: (participants + 1) model states per round; for
large models and long runs use ``--no-transcript`` (docs/privacy.md lists the cost).

The files are written off the training path: ``record`` keeps a private copy of the tensors
in the open batch, ``seal`` hands the batch to one writer thread as one file, and ``flush``
(at the end of a run) seals, waits for the pending files and then rewrites the index, so the
index never names a file that is not on disk. ``hand_over`` does the same on the writer
thread and then runs a job there (the simulator's checkpoint of the round), so a checkpoint
never precedes its round's record and the round's thread does not wait for either.

A file's time is a record too: when a client's update reached the disk says how long it
trained, which grows with its private size. So ``flush`` sets the times of every file it
waited for, of the index and of the folder to one value, the time the run's server view was
started (``server_epoch``: the time of ``server/config.json``): nothing in the transcript
tells one client's moment from another's (docs/threat-model.md, "Timing").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from privfedcal.errors import UsageError
from privfedcal.privacy.releases import ROUND_RECORD, UPDATE_RELEASE
from privfedcal.privacy.transcript_files import (
    BATCH_BYTES,
    Records,
    Writer,
    nbytes,
    read_entries,
)


class Transcript:
    """Append-only record of the server's view. ``directory=None`` keeps nothing on disk."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.entries: list[dict[str, Any]] = []
        self._writer: Writer | None = None
        #: the records not yet handed to the writer: their file's name, its tensors, bytes
        self._batch: tuple[str, Records] | None = None
        self._batch_bytes = 0
        # Each entry is encoded once, when recorded (json's C encoder: no indent), and the
        # index is rewritten from these strings; re-encoding the whole growing index on every
        # record made the default digits run spend a fifth of its time in json.
        self._encoded: list[str] = []
        #: (entries, bytes) of ``index.json`` as this process last wrote it: a later flush
        #: appends the new entries in place of the closing bracket
        self._on_disk: tuple[int, int] | None = None
        #: which attempt at the rounds after the last checkpoint this process records: 0
        #: in a run never stopped; after a resume that finds releases of those rounds on
        #: record, one more than theirs (``resume_after``), written into every entry
        self.attempt = 0
        self._epoch: int | None = None  # ns, read at the first flush (server_epoch)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            index = directory / "index.json"
            if index.exists():  # resumed run: keep what was recorded so far
                self.entries = json.loads(index.read_text())
                self._encoded = [json.dumps(e) for e in self.entries]

    def _write(self, round_: int, tensors: dict[str, torch.Tensor], copy: bool
               ) -> tuple[str, str] | None:
        """Add a record's tensors to the open batch: (its file, its key in the file)."""
        if self.directory is None:
            return None
        if self._batch is None:
            # a redo never writes over a file of an earlier attempt (one its stop left
            # unlisted)
            again = f"-a{self.attempt}" if self.attempt else ""
            self._batch = (f"{len(self.entries):05d}{again}-r{round_}-records.safetensors", [])
        key = f"{len(self.entries):05d}"
        # a private copy unless the caller hands the tensors over (``copy=False``): the
        # caller may change its tensors once record returns
        own = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        self._batch[1].append((key, {k: v.clone() for k, v in own.items()} if copy else own))
        self._batch_bytes += nbytes(own)
        name = self._batch[0]
        if self._batch_bytes >= BATCH_BYTES:
            self.seal()
        return name, key

    def seal(self) -> None:
        """Hand the records made since the last ``seal`` to the writer thread, as one file
        (the simulator seals once a round's updates are in, so the file is written while
        the round goes on; ``flush`` seals too)."""
        if self._batch is None or self.directory is None:
            return
        (name, records), size = self._batch, self._batch_bytes
        self._take_epoch(self.directory)
        # an error of the writer raised here leaves the batch open: the stopped run's
        # flush writes it, as its index names it
        self._started().put(records, str(self.directory / name), size)
        self._batch, self._batch_bytes = None, 0

    def _started(self) -> Writer:
        """The writer thread, started on first use."""
        if self._writer is None:
            self._writer = Writer(epoch=self._epoch)
        return self._writer

    def hand_over(self, job: Callable[[], None]) -> None:
        """Seal, and run ``job`` on the writer thread once the files handed over so far are
        written and ``index.json`` lists the entries recorded so far: the simulator's
        checkpoint, written in order after its round's record while the next round trains.
        ``wait`` (and ``flush``, ``close``) waits for it and raises what it raised."""
        self.seal()
        if self.directory is not None:
            self._take_epoch(self.directory)  # read here: the writer thread only stamps
        listed = len(self._encoded)  # entries recorded later go to a later index write

        def after_files() -> None:
            if self.directory is not None:
                self._index_through(listed)
            job()

        self._started().call(after_files)

    def wait(self) -> None:
        """Block until every file and job handed over is done; raise an error one met."""
        if self._writer is not None:
            self._writer.wait()

    def wait_for_jobs(self) -> None:
        """Block until the jobs handed over are done (not the files recorded after them);
        raise an error the writer met."""
        if self._writer is not None:
            self._writer.wait_calls()

    def record(self, *, round_: int, label: str, view: str, client: int | None,
               tensors: dict[str, torch.Tensor] | None = None, copy: bool = True,
               **info: Any) -> None:
        """``view``: "plain-upload" (one client's payload), "aggregate" (what was decrypted or
        summed), or "ciphertext" (sizes only). ``copy=False``: ``tensors`` are handed over
        (the caller never changes them again), kept without a private copy."""
        entry: dict[str, Any] = {"round": round_, "label": label, "view": view,
                                 "client": client, **info}
        if self.attempt:
            entry["attempt"] = self.attempt
        if tensors is not None:
            where = self._write(round_, tensors, copy)
            entry["file"] = None
            if where is not None:
                entry["file"], entry["key"] = where
        self.entries.append(entry)
        self._encoded.append(json.dumps(entry))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of a transcript that writes no files (``directory=None``,
        ``--no-transcript``): its entries (labels, views, clients, sizes, participants; no
        tensors), so that a resumed run still counts every upload and checks every secure
        sum of the whole run. A transcript on disk is read back from ``index.json``."""
        return {"entries": self.entries} if self.directory is None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        entries = state.get("entries")
        if self.directory is not None or entries is None:
            return
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise UsageError("the checkpoint's transcript entries must be a list of objects")
        self.entries = [dict(e) for e in entries]
        self._encoded = [json.dumps(e) for e in self.entries]

    def resume_after(self, round_: int) -> None:
        """On resume from the checkpoint of ``round_``: the rounds after it are redone, but
        what the server received of them before the stop stays on record (every release it
        holds is charged and checked, every byte counted); the redo's entries carry the
        next ``attempt`` index, so both attempts stay apart."""
        later = [int(e.get("attempt", 0)) for e in self.entries if e["round"] > round_]
        later += self._unlisted_attempts()
        if later:
            self.attempt = max(self.attempt, max(later) + 1)
        self.flush()

    def _unlisted_attempts(self) -> list[int]:
        """The attempts of files on disk that the index does not name: a process killed
        before it rewrote the index leaves them; they are kept, and never written over."""
        if self.directory is None:
            return []
        listed = {e.get("file") for e in self.entries}
        return [int(m.group(1)) if (m := re.match(r"^\d+-a(\d+)-", p.name)) else 0
                for p in self.directory.glob("*.safetensors") if p.name not in listed]

    def flush(self) -> None:
        """Wait for the files recorded so far (and the jobs handed over), then rewrite
        ``index.json``: a JSON array, one entry per line."""
        self.seal()
        self.wait()
        if self.directory is not None:
            self._index_through(len(self._encoded))

    def _index_through(self, listed: int) -> None:
        """``index.json`` listing the first ``listed`` entries, stamped with the view's
        time (on the writer thread from ``hand_over``: the recording thread only appends
        to the entries meanwhile, and writes the index itself only after ``wait``)."""
        assert self.directory is not None
        self._write_index(self.directory / "index.json", listed)
        epoch = self._take_epoch(self.directory)
        for path in [self.directory / "index.json", self.directory]:
            os.utime(path, ns=(epoch, epoch))

    def _write_index(self, path: Path, listed: int) -> None:
        """``index.json`` as the whole list of entries, one per line. Entries are only ever
        added, so when the file is as this process last wrote it, the new ones are written
        over its closing bracket: the same bytes as a rewrite, without truncating the file
        (on ext4, truncating and rewriting a file waits for its blocks to be allocated, the
        costliest step of a round's record)."""
        done, size = self._on_disk or (0, -1)
        if 0 < done <= listed and path.is_file() and path.stat().st_size == size:
            tail = "".join(",\n" + e for e in self._encoded[done:listed]) + "\n]\n"
            with open(path, "r+b") as f:
                f.seek(size - 3)  # the closing "\n]\n"
                f.write(tail.encode())
            self._on_disk = (listed, size - 3 + len(tail))
            return
        text = "[\n" + ",\n".join(self._encoded[:listed]) + "\n]\n" if listed else "[]\n"
        path.write_bytes(text.encode())
        self._on_disk = (listed, len(text))

    def _take_epoch(self, directory: Path) -> int:
        """The view's one time of ``directory``, read once per process; a resumed run's
        folder may hold files of an earlier process under another time (one stopped before
        its first checkpoint wrote them before ``config.json`` was written again): they take
        this one too."""
        if self._epoch is None:
            self._epoch = epoch = server_epoch(directory)
            for path in directory.iterdir():
                if path.is_file() and path.stat().st_mtime_ns != epoch:
                    os.utime(path, ns=(epoch, epoch))
        return self._epoch

    def close(self) -> None:
        """Flush, and stop the writer thread (a later ``record`` starts another)."""
        self.flush()
        if self._writer is not None:
            self._writer.stop()
            self._writer = None

    def uploaded_bytes(self) -> int:
        """Bytes of the calibration uploads (model updates are counted apart)."""
        return int(sum(e.get("bytes", 0) for e in self.entries
                       if e["view"] != "aggregate" and e["label"] != UPDATE_RELEASE))


def server_epoch(directory: Path) -> int:
    """The one time (ns) every file of the server's view carries: that of the view's
    ``config.json`` (written when the run starts), else now."""
    config = Path(directory).parent / "config.json"
    return config.stat().st_mtime_ns if config.is_file() else time.time_ns()


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return int(sum(v.numel() * v.element_size() for v in state.values()))


def record_round(transcript: Transcript, round_: int, state: dict[str, torch.Tensor],
                 participants: list[int]) -> None:
    """Once per round, before local training: the global state the server sends."""
    transcript.record(round_=round_, label=ROUND_RECORD, view="model-state", client=None,
                      tensors=state, participants=[int(c) for c in participants])


TASK_PREFIX = "task."


def sent_tensors(state: dict[str, torch.Tensor], task: Any) -> dict[str, torch.Tensor]:
    """What the server sends for a release: the model state plus the public tensors of the
    task (``task.public_tensors()`` when it has one, e.g. the head CReFF clients
    differentiate), the latter under ``TASK_PREFIX`` so the state loads on its own."""
    extra = getattr(task, "public_tensors", None)
    if extra is None:
        return state
    return {**state, **{TASK_PREFIX + k: v for k, v in extra().items()}}


def record_model_updates(transcript: Transcript, round_: int, clients: list[int],
                         states: list[dict[str, torch.Tensor]], weights: list[float] | None,
                         recipe: dict[str, Any], *, copy: bool = True) -> None:
    """Every participant's full local state after training, as the server receives it in
    the clear, with the aggregation weight it used (None if it never saw one) and the public
    local recipe (``local_epochs``, ``batch_size``, ``lr``) an attacker can simulate.
    ``copy=False``: the states are handed over (``Transcript.record``)."""
    for i, (c, st) in enumerate(zip(clients, states, strict=True)):
        transcript.record(round_=round_, label=UPDATE_RELEASE, view="plain-upload",
                          client=int(c), tensors=st, copy=copy,
                          weight=None if weights is None else float(weights[i]),
                          bytes=state_bytes(st), **recipe)


def secure_participants(entries: list[dict[str, Any]]) -> list[list[int]]:
    """The contributors of every securely aggregated release, from the server's record: for
    each decrypted aggregate, the clients whose ciphertexts of that round and label entered
    the sum (the whole-run check, privfedcal/privacy/cohorts.py, reads these)."""
    senders: dict[tuple[int, str, int], list[int]] = {}
    rows = []
    for e in entries:  # a redone round's attempts are separate releases
        key = (int(e["round"]), str(e["label"]), int(e.get("attempt", 0)))
        if e["view"] == "ciphertext":
            senders.setdefault(key, []).append(int(e["client"]))
        elif e["view"] == "aggregate" and key in senders:
            rows.append(sorted(senders.pop(key)))
    return rows


def load_transcript(directory: Path) -> list[dict[str, Any]]:
    """Entries with their tensors loaded (safetensors only)."""
    index = directory / "index.json"
    if not index.is_file():
        raise UsageError(f"no transcript in {directory}")
    entries = json.loads(index.read_text())
    read_entries(directory, entries)
    return entries
