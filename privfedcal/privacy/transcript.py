"""What the server observed, release by release, saved in the run folder for the attacks.

Unprotected uploads are recorded per client (that is what an honest-but-curious server
sees); protected ones as per-client ciphertext sizes plus the decrypted aggregate only.
Model updates are recorded too (``record_round`` / ``record_model_updates``): once per round
the global state sent and the participants, then every participant's full local state with
the aggregation weight the server used, its size on the wire and the public local recipe.
Files: ``transcript/index.json`` (one entry per release) and one safetensors file per entry.
Disk: (participants + 1) model states per round; for large models and long runs use
``--no-transcript`` (docs/privacy.md lists the cost).

The files are written off the training path: ``record`` copies the tensors and hands them to
one writer thread, and ``flush`` (the simulator calls it before each checkpoint and at the
end of a run) waits for the pending files and then rewrites the index, so the index never
names a file that is not on disk and a checkpoint never precedes its round's record.

A file's time is a record too: when a client's update reached the disk says how long it
trained, which grows with its private size. So ``flush`` sets the times of every file it
waited for, of the index and of the folder to one value, the time the run's server view was
started (``server_epoch``: the time of ``server/config.json``): nothing in the transcript
tells one client's moment from another's (docs/threat-model.md, "Timing").
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from privfedcal.errors import UsageError
from privfedcal.privacy.releases import ROUND_RECORD, UPDATE_RELEASE

#: bytes of tensors handed to the writer and not yet on disk at most: ``put`` waits beyond
#: it, so a recorder faster than the disk (a calibration release over thousands of
#: clients) holds a bounded copy of the server's view, not one per client
MAX_PENDING_BYTES = 256 * 2**20


class _Writer:
    """One daemon thread writing safetensors files in the order they were handed over. An
    error is kept and raised by the next ``put`` or ``wait``, in the recording thread."""

    def __init__(self, max_pending: int = MAX_PENDING_BYTES, epoch: int | None = None) -> None:
        self._jobs: queue.Queue[tuple[dict[str, torch.Tensor], str] | None] = queue.Queue()
        #: the one time (ns) each file gets as soon as it is written (``server_epoch``), so
        #: that even a process killed before its next flush leaves no per-client time
        self._epoch = epoch
        self._error: BaseException | None = None
        self._max_pending = max_pending
        self._pending = 0  # bytes queued, not yet written
        self._room = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="privfedcal-transcript",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    save_file(*job)
                    if self._epoch is not None:
                        os.utime(job[1], ns=(self._epoch, self._epoch))
            except BaseException as exc:  # handed to the recording thread
                self._error = exc
            finally:
                if job is not None:
                    with self._room:
                        self._pending -= _nbytes(job[0])
                        self._room.notify_all()
                self._jobs.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def put(self, tensors: dict[str, torch.Tensor], path: str) -> None:
        """Queue a file; wait first while the queued bytes would pass the bound (a single
        file larger than the bound waits for an empty queue)."""
        self._raise()
        size = _nbytes(tensors)
        with self._room:
            self._room.wait_for(lambda: self._pending == 0
                                or self._pending + size <= self._max_pending)
            self._pending += size
        self._jobs.put((tensors, path))

    def wait(self) -> None:
        """Block until every file handed over is written."""
        self._jobs.join()
        self._raise()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return int(sum(v.numel() * v.element_size() for v in tensors.values()))


class Transcript:
    """Append-only record of the server's view. ``directory=None`` keeps nothing on disk."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.entries: list[dict[str, Any]] = []
        self._writer: _Writer | None = None
        # Each entry is encoded once, when recorded (json's C encoder: no indent), and the
        # index is rewritten from these strings; re-encoding the whole growing index on every
        # record made the default digits run spend a fifth of its time in json.
        self._encoded: list[str] = []
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

    def _write(self, name: str, tensors: dict[str, torch.Tensor]) -> str | None:
        if self.directory is None:
            return None
        # a redo never writes over a file of an earlier attempt (one its stop left unlisted)
        again = f"-a{self.attempt}" if self.attempt else ""
        fname = f"{len(self.entries):05d}{again}-{name}.safetensors"
        self._take_epoch()
        if self._writer is None:
            self._writer = _Writer(epoch=self._epoch)
        # a private copy: the caller may change its tensors once record returns
        self._writer.put({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                         str(self.directory / fname))
        return fname

    def record(self, *, round_: int, label: str, view: str, client: int | None,
               tensors: dict[str, torch.Tensor] | None = None, **info: Any) -> None:
        """``view``: "plain-upload" (one client's payload), "aggregate" (what was decrypted or
        summed), or "ciphertext" (sizes only)."""
        entry: dict[str, Any] = {"round": round_, "label": label, "view": view,
                                 "client": client, **info}
        if self.attempt:
            entry["attempt"] = self.attempt
        if tensors is not None:
            tag = f"r{round_}-{label}-{view}" + (f"-c{client}" if client is not None else "")
            entry["file"] = self._write(tag, tensors)
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
        """Wait for the files recorded so far, then rewrite ``index.json``: a JSON array,
        one entry per line."""
        if self.directory is not None:
            if self._writer is not None:
                self._writer.wait()
            text = "[\n" + ",\n".join(self._encoded) + "\n]\n" if self._encoded else "[]\n"
            (self.directory / "index.json").write_text(text)
            self._take_epoch()
            for path in [self.directory / "index.json", self.directory]:
                os.utime(path, ns=(self._epoch, self._epoch))

    def _take_epoch(self) -> None:
        """Read the view's one time once per process; a resumed run's folder may hold files
        of an earlier process under another time (one stopped before its first checkpoint
        wrote them before ``config.json`` was written again): they take this one too."""
        if self._epoch is not None or self.directory is None:
            return
        self._epoch = epoch = server_epoch(self.directory)
        for path in self.directory.iterdir():
            if path.is_file() and path.stat().st_mtime_ns != epoch:
                os.utime(path, ns=(epoch, epoch))

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
                         recipe: dict[str, Any]) -> None:
    """Every participant's full local state after training, as the server receives it in
    the clear, with the aggregation weight it used (None if it never saw one) and the public
    local recipe (``local_epochs``, ``batch_size``, ``lr``) an attacker can simulate."""
    for i, (c, st) in enumerate(zip(clients, states, strict=True)):
        transcript.record(round_=round_, label=UPDATE_RELEASE, view="plain-upload",
                          client=int(c), tensors=st,
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
    for e in entries:
        if e.get("file"):
            e["tensors"] = load_file(str(directory / e["file"]))
    return entries
