"""DP-SGD local training that each client releases once, whatever stops the run.

Under ``--dp-train`` a client's update is a DP release: its noise and its Poisson batches
come from OS entropy, so training the same client again from the same global state gives
another draw. A round redone after a stop (its checkpoint not yet written) would hand the
server a second, independent release of the same client's data, charged once. This trainer
wraps the run's trainer: every update is journaled by its client
(privacy/release_journal.py) before it leaves, and a client whose update of this round is
in the journal re-sends that update instead of training again, so the server sees the same
value twice, which is worth nothing new. The charge (``NoiseStage.after_training``) is
re-applied by the redo from the checkpoint's ledgers, so it ends where the first attempt
would have.

Only for methods without a per-client state (every method ``Algorithm.dp_sgd`` admits):
a re-sent update comes without one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from privfedcal.algorithms.algorithm import State
from privfedcal.federation.local import LocalResult
from privfedcal.federation.workers import Trainer, TrainJob
from privfedcal.privacy.release_journal import ReleaseJournal


class JournaledTrainer:
    """``Trainer`` whose clients journal each update of ``label`` before it is sent and
    re-send the journaled one in a redone round. ``charge``: what each update is charged
    (noise multiplier, sample rate, steps), kept with it."""

    def __init__(self, inner: Trainer, journal: ReleaseJournal, label: str,
                 charge: dict[str, Any] | None = None) -> None:
        self.inner, self.journal, self.label, self.charge = inner, journal, label, charge

    def train(self, global_state: State, jobs: list[TrainJob], round_: int,
              consume: Callable[[State], None] | None = None) -> list[LocalResult]:
        """``Trainer.train``: journaled updates re-sent, the others trained (runs of
        consecutive jobs at once, so states still reach ``consume`` in job order)."""
        kept = [self.journal.get(round_, self.label, job.client) for job in jobs]
        out: list[LocalResult] = []
        i = 0
        while i < len(jobs):
            if kept[i] is not None:
                self.journal.reused += 1
                state = {k: v.to(global_state[k].device if k in global_state else "cpu")
                         for k, v in kept[i][0].items()}  # type: ignore[index]
                if consume is not None:
                    consume(state)
                    state = {}
                out.append(LocalResult(state, None, None))
                i += 1
                continue
            j = i
            while j < len(jobs) and kept[j] is None:
                j += 1
            out.extend(self._train(global_state, jobs[i:j], round_, consume))
            i = j
        return out

    def _train(self, global_state: State, jobs: list[TrainJob], round_: int,
               consume: Callable[[State], None] | None) -> list[LocalResult]:
        """``jobs`` trained by the inner trainer, each update journaled before it leaves
        (before ``consume`` takes it, or before the results are returned)."""
        clients = iter([job.client for job in jobs])

        def journaled(state: State) -> None:
            self.journal.put(round_, self.label, next(clients), state, charge=self.charge)
            assert consume is not None
            consume(state)

        if consume is not None:
            return self.inner.train(global_state, jobs, round_, consume=journaled)
        results = self.inner.train(global_state, jobs, round_)
        for job, result in zip(jobs, results, strict=True):
            self.journal.put(round_, self.label, job.client, result.state, charge=self.charge)
        return results

    def close(self) -> None:
        self.inner.close()

    def terminate(self) -> None:
        self.inner.terminate()


__all__ = ["JournaledTrainer"]
