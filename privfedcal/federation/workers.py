"""Trainers: run the selected clients' local training in this process or in N workers.

A trainer is anything with the ``Trainer`` protocol below: the simulator hands it the round's
``TrainJob``s and a ``consume`` callback and never asks which trainer it is (the in-process
and worker-pool trainers here, ``flower/flower_simulator.py``'s ``FlowerTrainer``).

``--workers N`` starts N spawned processes, each with one model object, its own copy of the
method, and the training tensors received once through shared memory. Each round the global
state is put in shared memory once; workers return their new states the same way. Client
``k`` trains with the generator of (seed, round, k) wherever it runs, so results do not depend
on the number of workers (for the same ``--threads``: BLAS reductions may differ in the last
bits between thread counts).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, overload

import torch
import torch.multiprocessing as tmp
from torch import Tensor

from privfedcal.algorithms.algorithm import Algorithm, State
from privfedcal.federation.local import LocalResult, LocalSpec, set_deterministic, train_client
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.settings.run_config import MODEL_FAMILY


@dataclass
class TrainJob:
    """One client's local training in a round: its sample indices (None where the client's
    node holds them, under Flower) and its kept state."""

    client: int
    idx: Tensor | None
    client_state: State | None

    @property
    def indices(self) -> Tensor:
        """The sample indices, for a trainer that plays the client."""
        if self.idx is None:
            raise RuntimeError(f"client {self.client}'s samples are held by its node")
        return self.idx


class Trainer(Protocol):
    """Local training of a round's clients, wherever it runs."""

    def train(self, global_state: State, jobs: list[TrainJob], round_: int,
              consume: Callable[[State], None] | None = None) -> list[LocalResult]:
        """One ``LocalResult`` per job, in job order. With ``consume`` each new state is
        handed to it in job order and dropped (its slot in the results is an empty dict),
        so the caller can average as states arrive without holding them all."""
        ...

    def close(self) -> None:
        """Release the trainer after a finished run."""
        ...

    def terminate(self) -> None:
        """Stop at once (an error or Ctrl-C)."""
        ...


class InProcessTrainer:
    """Trains clients one after the other with the server's own model object."""

    def __init__(self, model: FeatureClassifier, algo: Algorithm, x: Tensor, y: Tensor,
                 spec: LocalSpec) -> None:
        self.model, self.algo, self.x, self.y, self.spec = model, algo, x, y, spec

    def train(self, global_state: State, jobs: list[TrainJob], round_: int,
              consume: Callable[[State], None] | None = None) -> list[LocalResult]:
        """``Trainer.train``, one client after another in this process."""
        out = []
        for job in jobs:
            state, client_state, loss = train_client(
                self.model, self.algo, global_state, job.client_state, self.x, self.y,
                job.indices, self.spec, round_, job.client)
            if consume is not None:
                consume(state)
                state = {}
            out.append(LocalResult(state, client_state, loss))
        return out

    def close(self) -> None:
        pass

    def terminate(self) -> None:
        pass


# ---- worker process side ------------------------------------------------------------------
_W: dict = {}


def _worker_init(build: Callable[[], tuple[FeatureClassifier, Algorithm]], x: Tensor, y: Tensor,
                 spec: LocalSpec, threads: int, device: str = "cpu",
                 deterministic: bool = False) -> None:
    # Ctrl-C reaches every process of the terminal's group: the server process alone
    # handles it (and terminates the pool); a worker would print its own traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    set_deterministic(deterministic)
    dev = torch.device(device)
    model, algo = build()
    # on a GPU every worker holds its own copy of the training tensors on the device
    _W.update(model=model.to(dev), algo=algo, x=x.to(dev), y=y.to(dev), spec=spec, device=dev)


def _on_device(state: State | None) -> State | None:
    if state is None:
        return None
    return {k: v.to(_W["device"]) for k, v in state.items()}


def _worker_train(args: tuple[State, list[TrainJob], int]) -> list[tuple]:
    global_state, jobs, round_ = args
    out = []
    for job in jobs:
        state, client_state, loss = train_client(_W["model"], _W["algo"], global_state,
                                                 _on_device(job.client_state), _W["x"], _W["y"],
                                                 job.indices.to(_W["device"]), _W["spec"], round_,
                                                 job.client)
        out.append((pack_state(state), pack_state(client_state), loss))
    return out


def _worker_collect(args: tuple[State, object, list[Tensor], object]) -> list:
    """One payload task on a share of the clients (``Simulator.collect`` on the pool)."""
    state, task, idxs, bound = args
    model = _W["model"]
    model.load_state_dict(state)
    model.eval()
    out = []
    for idx in idxs:
        idx = idx.to(_W["device"])
        out.append(pack_state(task.compute(model, _W["x"][idx], _W["y"][idx], bound)))  # type: ignore[attr-defined]
    return out


def balanced_shares(sizes: list[int], workers: int) -> list[list[int]]:
    """Positions of ``sizes`` split into ``workers`` shares of similar total size (largest
    first onto the least loaded share); each share keeps its positions in ascending order."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        w = load.index(min(load))
        shares[w].append(i)
        load[w] += sizes[i]
    return [sorted(s) for s in shares if s]


#: a state packed for another process: one flat buffer per dtype name, and per tensor
#: (key, dtype, shape) in state order
Packed = tuple[dict[str, Tensor], list[tuple[str, torch.dtype, tuple[int, ...]]]]


def pack_state(state: State | None) -> Packed | None:
    """One contiguous buffer per dtype instead of one shared-memory segment per tensor:
    each segment costs a file descriptor round trip between processes."""
    if state is None:
        return None
    groups: dict[torch.dtype, list[Tensor]] = {}
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for k, v in state.items():
        groups.setdefault(v.dtype, []).append(v.reshape(-1))
        layout.append((k, v.dtype, tuple(v.shape)))
    # on the CPU: tensors cross processes through shared memory, never as CUDA handles
    return {str(dt): torch.cat(ts).cpu() for dt, ts in groups.items()}, layout


@overload
def unpack_state(packed: Packed) -> State: ...
@overload
def unpack_state(packed: None) -> None: ...
def unpack_state(packed: Packed | None) -> State | None:
    if packed is None:
        return None
    flats, layout = packed
    offsets: dict[str, int] = {}
    out: State = {}
    for k, dt, shape in layout:
        key = str(dt)
        n = 1
        for s in shape:
            n *= s
        start = offsets.get(key, 0)
        out[k] = flats[key][start:start + n].view(shape)
        offsets[key] = start + n
    return out


class WorkerPoolTrainer:
    """Trains clients in N spawned processes, on the CPU or all on one GPU (each worker then
    keeps the training tensors on the device; what crosses processes stays on the CPU:
    sample indices, states, payloads)."""

    def __init__(self, build: Callable[[], tuple[FeatureClassifier, Algorithm]], x: Tensor,
                 y: Tensor, spec: LocalSpec, workers: int, threads: int,
                 device: torch.device | str = "cpu", deterministic: bool = False) -> None:
        x, y = x.cpu().share_memory_(), y.cpu().share_memory_()
        ctx = tmp.get_context("spawn")
        self.workers = workers
        with _sigint_ignored_by_children():
            self.pool = ctx.Pool(workers, initializer=_worker_init,
                                 initargs=(build, x, y, spec, threads, str(device), deterministic))

    def train(self, global_state: State, jobs: list[TrainJob], round_: int,
              consume: Callable[[State], None] | None = None) -> list[LocalResult]:
        """``Trainer.train`` on the worker processes."""
        shared = _shared(global_state)
        # One task per worker with a balanced share of the clients (largest first): fewer
        # round trips than one task per client, and results come back in client order.
        shares = balanced_shares([int(j.indices.numel()) for j in jobs], self.workers)
        pending = [(share, self.pool.apply_async(
            _worker_train, ((shared, [_cpu_job(jobs[i]) for i in share], round_),)))
            for share in shares]
        results: list[LocalResult | None] = [None] * len(jobs)
        for share, p in pending:
            for i, (state, client_state, loss) in zip(share, p.get(), strict=True):
                results[i] = LocalResult(unpack_state(state), unpack_state(client_state), loss)
        if consume is not None:
            for i, r in enumerate(results):
                consume(r.state)  # type: ignore[union-attr]
                results[i] = r._replace(state={})  # type: ignore[union-attr]
        return results  # type: ignore[return-value]

    def collect(self, task: object, idxs: list[Tensor], state: State, bound: object
                ) -> list[dict[str, Tensor]]:
        """``task.compute`` for every client (its sample indices ``idxs``) with the model in
        ``state``, spread over the workers; uploads in the order of ``idxs``. Each worker
        runs with the same thread count as the server process, so the uploads are the ones
        the serial loop computes."""
        shared = _shared(state)
        shares = balanced_shares([int(i.numel()) for i in idxs], self.workers)
        pending = [(share, self.pool.apply_async(
            _worker_collect, ((shared, task, [idxs[i].cpu() for i in share], bound),)))
            for share in shares]
        out: list[dict[str, Tensor] | None] = [None] * len(idxs)
        for share, p in pending:
            for i, packed in zip(share, p.get(), strict=True):
                out[i] = unpack_state(packed)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.close()
        self.pool.join()

    def terminate(self) -> None:
        """Stop the workers now (an interrupted or failed run): ``close`` would wait for
        the round they are training. A worker stopped while it received tensors breaks the
        connection of multiprocessing's file-descriptor server thread in this process; the
        run is ending with its own error, so that thread's connection error is not printed."""
        threading.excepthook = _quiet_thread_connection_errors(threading.excepthook)
        # multiprocessing's resource sharer reports its thread's errors through
        # sys.excepthook itself (resource_sharer._serve), not threading.excepthook
        sys.excepthook = _quiet_connection_errors(sys.excepthook)
        self.pool.terminate()
        self.pool.join()


def _from_multiprocessing(exc_type, tb) -> bool:
    """A connection error raised inside multiprocessing's own modules (its resource sharer
    or a pool connection): what a stopped worker leaves behind, and nothing else."""
    if not issubclass(exc_type, OSError | EOFError):
        return False
    while tb is not None:
        if "multiprocessing" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _quiet_thread_connection_errors(hook):
    def excepthook(args: threading.ExceptHookArgs) -> None:
        if not _from_multiprocessing(args.exc_type, args.exc_traceback):
            hook(args)
    return excepthook


def _quiet_connection_errors(hook):
    def excepthook(exc_type, exc, tb) -> None:
        if not _from_multiprocessing(exc_type, tb):
            hook(exc_type, exc, tb)
    return excepthook


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Start processes that ignore Ctrl-C from their first instruction: an ignored SIGINT
    survives exec, and Python then installs no KeyboardInterrupt handler (the initializer's
    SIG_IGN comes only after torch is imported, seconds later). Main thread only (where
    signals are handled); a Ctrl-C during the few milliseconds of the spawn is dropped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _cpu_job(job: TrainJob) -> TrainJob:
    cs = job.client_state
    return TrainJob(job.client, job.indices.cpu(),
               None if cs is None else {k: v.cpu() for k, v in cs.items()})


def _shared(state: State) -> State:
    return {k: v.detach().cpu().clone().share_memory_() for k, v in state.items()}


def default_threads(workers: int, model: str | None = None) -> int:
    """Torch threads per process when ``--threads`` is not given: one for the small models
    (``config.MODEL_FAMILY``: the digits MLP and CNN), whose tiny matrix products gain
    nothing from a second thread and lose many-fold when other processes compete for the
    cores (the default digits run: 6.8 s with one thread against 7.3-8.2 s with two on a
    quiet 2-core machine, 5.8 s against 40 s at a load average of 2; docs/results/engine.md);
    the cores shared among the worker processes otherwise."""
    if model is not None and MODEL_FAMILY.get(model) == "small":
        return 1
    return max(1, (mp.cpu_count() or 1) // workers)
