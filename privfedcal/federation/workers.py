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


def _worker_train(args: tuple[State, Job, int]) -> Result:
    global_state, job, round_ = args
    state, client_state, loss = train_client(_W["model"], _W["algo"], global_state,
                                             job.client_state, _W["x"], _W["y"], job.idx,
                                             _W["spec"], round_, job.client)
    return state, client_state, loss


class WorkerPoolTrainer:
    """Trains clients in N spawned processes (CPU only)."""

    def __init__(self, build: Callable[[], tuple[FeatureClassifier, Algorithm]], x: Tensor,
                 y: Tensor, spec: LocalSpec, workers: int, threads: int) -> None:
        x, y = x.cpu().share_memory_(), y.cpu().share_memory_()
        ctx = tmp.get_context("spawn")
        self.pool = ctx.Pool(workers, initializer=_worker_init,
                             initargs=(build, x, y, spec, threads))

    def train(self, global_state: State, jobs: list[Job], round_: int,
              on_done: Callable[[int], None] | None = None) -> list[Result]:
        shared = {k: v.detach().cpu().clone().share_memory_() for k, v in global_state.items()}
        results: list[Result | None] = [None] * len(jobs)
        pending = [self.pool.apply_async(_worker_train, ((shared, job, round_),)) for job in jobs]
        for i, p in enumerate(pending):
            results[i] = p.get()
            if on_done:
                on_done(jobs[i].client)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def default_threads(workers: int) -> int:
    return max(1, (mp.cpu_count() or 1) // workers)
