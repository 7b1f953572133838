"""Trainers: run the selected clients' local training in this process or in N workers.

``--workers N`` starts N spawned processes, each with one model object, its own copy of the
method, and the training tensors received once through shared memory. Each round the global
state is put in shared memory once; workers return their new states the same way. Client
``k`` trains with the generator of (seed, round, k) wherever it runs, so results do not depend
on the number of workers (for the same ``--threads``: BLAS reductions may differ in the last
bits between thread counts).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.multiprocessing as tmp
from torch import Tensor

from privfedcal.algorithms.base import Algorithm, State
from privfedcal.federation.local import LocalSpec, train_client
from privfedcal.models.base import FeatureClassifier


@dataclass
class Job:
    client: int
    idx: Tensor
    client_state: State | None


Result = tuple[State, State | None, float]


class InProcessTrainer:
    """Trains clients one after the other with the server's own model object."""

    def __init__(self, model: FeatureClassifier, algo: Algorithm, x: Tensor, y: Tensor,
                 spec: LocalSpec) -> None:
        self.model, self.algo, self.x, self.y, self.spec = model, algo, x, y, spec

    def train(self, global_state: State, jobs: list[Job], round_: int,
              on_done: Callable[[int], None] | None = None) -> list[Result]:
        out = []
        for job in jobs:
            out.append(train_client(self.model, self.algo, global_state, job.client_state,
                                    self.x, self.y, job.idx, self.spec, round_, job.client))
            if on_done:
                on_done(job.client)
        return out

    def close(self) -> None:
        pass


# ---- worker process side ------------------------------------------------------------------
_W: dict = {}


def _worker_init(build: Callable[[], tuple[FeatureClassifier, Algorithm]], x: Tensor, y: Tensor,
                 spec: LocalSpec, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    model, algo = build()
    _W.update(model=model, algo=algo, x=x, y=y, spec=spec)


def _worker_train(args: tuple[State, list[Job], int]) -> list[Result]:
    global_state, jobs, round_ = args
    out = []
    for job in jobs:
        state, client_state, loss = train_client(_W["model"], _W["algo"], global_state,
                                                 job.client_state, _W["x"], _W["y"], job.idx,
                                                 _W["spec"], round_, job.client)
        out.append((pack_state(state), pack_state(client_state), loss))
    return out


def pack_state(state: State | None) -> tuple[Tensor, list] | None:
    """One contiguous buffer per dtype instead of one shared-memory segment per tensor:
    each segment costs a file descriptor round trip between processes."""
    if state is None:
        return None
    groups: dict[torch.dtype, list[Tensor]] = {}
    layout = []
    for k, v in state.items():
        groups.setdefault(v.dtype, []).append(v.reshape(-1))
        layout.append((k, v.dtype, tuple(v.shape)))
    return {str(dt): torch.cat(ts) for dt, ts in groups.items()}, layout


def unpack_state(packed) -> State | None:
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
    """Trains clients in N spawned processes (CPU only)."""

    def __init__(self, build: Callable[[], tuple[FeatureClassifier, Algorithm]], x: Tensor,
                 y: Tensor, spec: LocalSpec, workers: int, threads: int) -> None:
        x, y = x.cpu().share_memory_(), y.cpu().share_memory_()
        ctx = tmp.get_context("spawn")
        self.workers = workers
        self.pool = ctx.Pool(workers, initializer=_worker_init,
                             initargs=(build, x, y, spec, threads))

    def train(self, global_state: State, jobs: list[Job], round_: int,
              on_done: Callable[[int], None] | None = None) -> list[Result]:
        shared = {k: v.detach().cpu().clone().share_memory_() for k, v in global_state.items()}
        # One task per worker with a balanced share of the clients (largest first): fewer
        # round trips than one task per client, and results come back in client order.
        shares: list[list[int]] = [[] for _ in range(self.workers)]
        load = [0] * self.workers
        for i in sorted(range(len(jobs)), key=lambda i: -int(jobs[i].idx.numel())):
            w = load.index(min(load))
            shares[w].append(i)
            load[w] += int(jobs[i].idx.numel())
        pending = [(share, self.pool.apply_async(
            _worker_train, ((shared, [jobs[i] for i in share], round_),)))
            for share in shares if share]
        results: list[Result | None] = [None] * len(jobs)
        for share, p in pending:
            for i, (state, client_state, loss) in zip(share, p.get(), strict=True):
                results[i] = (unpack_state(state), unpack_state(client_state), loss)
                if on_done:
                    on_done(jobs[i].client)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def default_threads(workers: int) -> int:
    return max(1, (mp.cpu_count() or 1) // workers)
