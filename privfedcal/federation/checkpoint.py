"""Checkpoints in safe formats only: tensors in safetensors, everything else in JSON.

A checkpoint holds the global model, the method's server state, per-client states (MOON's
previous models), the calibrator's state and the round reached; nested dicts are flattened
to ``a/b/c`` tensor keys plus a JSON skeleton. Nothing here ever unpickles.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from privfedcal.errors import UsageError
from privfedcal.privacy.removals import pending, remove_later, wait_for_removals
from privfedcal.privacy.transcript_files import write_tensors

_TENSOR = "__tensor__"


#: values that hold no tensor, checked first: a checkpoint is mostly the run's history
_LEAVES = frozenset({int, float, str, bool, type(None)})


def flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """Move tensors of a nested dict/list structure into ``tensors``; return the skeleton."""
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        tensors[key] = obj.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        return {str(k): flatten(v, tensors, f"{prefix}/{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if all(type(v) in _LEAVES for v in obj):
            return list(obj)
        return [flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    return obj


def snapshot(obj: Any, *, clone: bool = True) -> Any:
    """A copy of a nested dict/list structure that its owner may go on changing (a list
    that grows, a tensor updated in place) while the copy is written on another thread:
    new containers, each tensor detached and cloned (``clone=False``: kept as it is, for
    tensors their owner only ever replaces)."""
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if clone else obj.detach()
    if isinstance(obj, dict):
        return {k: snapshot(v, clone=clone) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if all(type(v) in _LEAVES for v in obj):
            return list(obj)
        return [snapshot(v, clone=clone) for v in obj]
    return obj


def unflatten(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, dict):
        if set(skel) == {_TENSOR}:
            return tensors[skel[_TENSOR]]
        return {k: unflatten(v, tensors) for k, v in skel.items()}
    if isinstance(skel, list):
        return [unflatten(v, tensors) for v in skel]
    return skel


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) until the block is done, then raise it: the two renames
    that swap a checkpoint in must not be separated, or the folder would hold only
    ``checkpoint.old``. Only in the main thread (where Python handles signals) and only
    when SIGINT raises KeyboardInterrupt there (the default handler); on another thread
    (the simulator's writer) nothing is needed: signals reach the main thread, whose stop
    waits for the writer (``Simulator.close``)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def save_checkpoint(directory: Path, payload: dict[str, Any], *,
                    background: bool = False) -> None:
    """Write atomically: a half-written checkpoint never replaces a good one, and Ctrl-C
    during the swap waits for it to finish. Any thread may call it with a ``payload`` no
    other thread changes meanwhile (``snapshot``). ``background``: the replaced checkpoint is
    removed on a thread (privacy/removals.py; the next save of ``directory`` waits for it
    first)."""
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    if pending(old):
        wait_for_removals()
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    skel = flatten(payload, tensors)
    write_tensors(str(tmp / "state.safetensors"), tensors)
    (tmp / "meta.json").write_text(json.dumps(skel))
    with interrupts_deferred():
        if directory.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(directory, old)
        os.replace(tmp, directory)
    if old.exists():
        if background:
            remove_later([old])
        else:
            shutil.rmtree(old)


def load_checkpoint(directory: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    meta, state = directory / "meta.json", directory / "state.safetensors"
    if not meta.is_file() or not state.is_file():
        raise UsageError(f"no checkpoint in {directory} (expected meta.json and state.safetensors)")
    try:
        tensors = load_file(str(state), device=str(device))
        skel = json.loads(meta.read_text())
    except Exception as exc:  # corrupt files
        raise UsageError(f"cannot read checkpoint {directory}: {exc}") from None
    return unflatten(skel, tensors)


def checkpoint_round(run_dir: Path) -> int:
    """The round the checkpoint of ``run_dir`` holds (0 when there is none)."""
    meta = run_dir / "checkpoint" / "meta.json"
    if not meta.is_file():
        return 0
    try:
        return int(json.loads(meta.read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"cannot read the checkpoint in {run_dir}") from None
