"""The transcript's tensors on disk: one safetensors file per batch of records, written by one
thread off the training path, and read back in either layout.

A batch holds every record made between two ``Transcript.seal`` calls (a round's global
state and its updates, or a calibration release's uploads), each record's tensors under
``<key>/<name>`` where ``key`` is the record's place in the index (five digits): one file
per round instead of one per update, whose fixed cost (create, serialise, stamp) was most of
what the transcript took from a round. The file is a plain safetensors file: any safetensors
reader opens it. Run folders written with one file per record (no ``key`` in their entries)
are read the same way (``read_entry``, ``read_entries``).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

#: bytes of tensors handed to the writer and not yet on disk at most: ``put`` waits beyond
#: it, so a recorder faster than the disk (a calibration release over thousands of
#: clients) holds a bounded copy of the server's view, not one per client
MAX_PENDING_BYTES = 256 * 2**20
#: a batch is handed to the writer once it holds this many bytes, without waiting for the
#: next ``seal``: a release over many clients is written in several files, not held whole
BATCH_BYTES = 64 * 2**20

#: safetensors' dtype names, in the order its writer lays tensors out (then by name), so
#: that a file is byte for byte the one ``save_file`` writes; a dtype outside the table is
#: written by safetensors itself
_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
           torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPES)}

Records = list[tuple[str, dict[str, torch.Tensor]]]


class _Call:
    """A function queued on a writer; ``done`` is set once it ran (or was skipped)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.done = fn, threading.Event()


#: a writer's job: a file of records (records, path, bytes), or a function run in turn
Job = tuple[Records, str, int] | _Call


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return int(sum(v.numel() * v.element_size() for v in tensors.values()))


def write_records(path: str, records: Records) -> None:
    """One safetensors file holding every record's tensors under ``<key>/<name>``."""
    write_tensors(path, {f"{key}/{name}": t for key, tensors in records
                         for name, t in tensors.items()})


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors file ``save_file`` writes of ``tensors`` (contiguous, on the CPU),
    their memory written as it is: no serialised copy in between, and tensors that share
    memory need no copy of their own (``save_file`` refuses them)."""
    if any(t.dtype not in _DTYPES for t in tensors.values()):
        save_file({k: t.clone() for k, t in tensors.items()}, path)
        return
    header: dict[str, Any] = {}
    chunks = []
    offset = 0
    # the widest elements first (every tensor starts aligned to its element size), as
    # safetensors orders them
    for name, t in sorted(tensors.items(), key=lambda kv: (_RANK[kv[1].dtype], kv[0])):
        data = t.reshape(-1).view(torch.uint8).numpy().data
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        chunks.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for data in chunks:
            f.write(data)


class Writer:
    """One daemon thread writing batches of records, and running the functions handed to
    ``call`` (the simulator's checkpoint), in the order they were handed over. An error is
    kept and raised by the next ``put``, ``call`` or ``wait``, in the recording thread; until
    then no function runs, nor any file after a file that failed."""

    def __init__(self, max_pending: int = MAX_PENDING_BYTES, epoch: int | None = None) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        #: the one time (ns) each file gets as soon as it is written (``server_epoch``), so
        #: that even a process killed before its next flush leaves no per-client time
        self._epoch = epoch
        self._error: BaseException | None = None
        # a file (a function) failed: jobs (functions) skipped until the error is raised
        self._failed_file = self._failed_call = False
        self._max_pending = max_pending
        self._pending = 0  # bytes queued, not yet written
        self._last_call: _Call | None = None
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
                if not (self._failed_file or self._failed_call and isinstance(job, _Call)):
                    self._run(job)
            except BaseException as exc:  # handed to the recording thread
                # after a failure no function runs (no checkpoint follows a file, or a
                # checkpoint, that failed); after a failed function the files are still
                # written (the index the stopped run writes names them)
                with self._room:
                    self._error = self._error or exc
                    self._failed_file = self._failed_file or isinstance(job, tuple)
                    self._failed_call = True
            finally:
                if isinstance(job, tuple):
                    with self._room:
                        self._pending -= job[2]
                        self._room.notify_all()
                elif job is not None:
                    job.done.set()
                self._jobs.task_done()

    def _run(self, job: Job) -> None:
        if not isinstance(job, tuple):
            job.fn()
            return
        write_records(job[1], job[0])
        if self._epoch is not None:
            os.utime(job[1], ns=(self._epoch, self._epoch))

    def _raise(self) -> None:
        with self._room:
            exc, self._error = self._error, None
            self._failed_file = self._failed_call = False
        if exc is not None:
            raise exc

    def put(self, records: Records, path: str, size: int) -> None:
        """Queue a file of ``size`` bytes of tensors; wait first while the queued bytes
        would pass the bound (a single file larger than the bound waits for an empty
        queue)."""
        self._raise()
        with self._room:
            self._room.wait_for(lambda: self._pending == 0
                                or self._pending + size <= self._max_pending)
            self._pending += size
        self._jobs.put((records, path, size))

    def call(self, job: Callable[[], None]) -> None:
        """Queue ``job``, run on the writer thread once every file handed over before it is
        written."""
        self._raise()
        self._last_call = call = _Call(job)
        self._jobs.put(call)

    def wait_calls(self) -> None:
        """Block until the functions handed to ``call`` are done (files queued after them
        may still be written); raise an error a job met."""
        if self._last_call is not None:
            self._last_call.done.wait()
        self._raise()

    def wait(self) -> None:
        """Block until every file and function handed over is done."""
        self._jobs.join()
        self._raise()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def read_entry(directory: Path, entry: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """One entry's tensors (None: it has none, or its file is not on disk), from a file of
    batched records (the entry's ``key``) or a file of its own."""
    name = entry.get("file")
    path = Path(directory) / name if name else None
    if path is None or not path.is_file():
        return None
    key = entry.get("key")
    if key is None:
        return load_file(str(path))
    prefix = f"{key}/"
    with safe_open(str(path), framework="pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def read_entries(directory: Path, entries: Iterable[dict[str, Any]]) -> None:
    """Every entry's tensors loaded into it (``entry["tensors"]``), each file read once."""
    batches: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for e in entries:
        name = e.get("file")
        if not name:
            continue
        if e.get("key") is None:
            e["tensors"] = load_file(str(Path(directory) / name))
            continue
        if name not in batches:
            split: dict[str, dict[str, torch.Tensor]] = {}
            for k, t in load_file(str(Path(directory) / name)).items():
                key, _, tensor = k.partition("/")
                split.setdefault(key, {})[tensor] = t
            batches[name] = split
        e["tensors"] = batches[name].get(str(e["key"]), {})


__all__ = ["BATCH_BYTES", "MAX_PENDING_BYTES", "Writer", "read_entries", "read_entry",
           "write_records", "write_tensors"]
