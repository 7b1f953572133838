"""Files and folders removed on one background thread: what a round has replaced (the previous
checkpoint's folder, the journal's releases of checkpointed rounds).

On ext4 removing a folder, or a file fsynced moments ago, waits for the disk (about 3 ms per
removal on the machine of docs/results/engine.md), and nothing in a round needs it gone. One
thread for the process, started once (starting a thread per removal cost a round about a
millisecond); ``wait_for_removals`` blocks until the queue is empty (a run's ``close``, and
at interpreter exit) and raises the first error a removal met.
"""

from __future__ import annotations

import atexit
import queue
import shutil
import threading
from pathlib import Path

_jobs: queue.Queue[list[Path]] = queue.Queue()
_errors: list[BaseException] = []
_lock = threading.Lock()
_thread: threading.Thread | None = None


def _loop() -> None:
    while True:
        paths = _jobs.get()
        try:
            for path in paths:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        except BaseException as exc:  # raised by the next wait_for_removals
            _errors.append(exc)
        finally:
            _jobs.task_done()


def remove_later(paths: list[Path]) -> None:
    """Queue ``paths`` (files or folders) for removal, in order."""
    global _thread
    if not paths:
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="privfedcal-removals", daemon=True)
            _thread.start()
            atexit.register(wait_for_removals)
    _jobs.put(list(paths))


def wait_for_removals() -> None:
    """Block until every queued removal is done; raise the first error one met."""
    _jobs.join()
    if _errors:
        exc = _errors.pop(0)
        _errors.clear()
        raise exc


def pending(path: Path) -> bool:
    """Whether ``path`` may still be queued for removal (it exists and removals are queued)."""
    return _jobs.unfinished_tasks > 0 and path.exists()


__all__ = ["pending", "remove_later", "wait_for_removals"]
