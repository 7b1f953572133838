"""DP-SGD updates journaled by their clients and re-sent, in job order, in a redone round."""

from __future__ import annotations

import torch

from privfedcal.federation.journaled_training import JournaledTrainer
from privfedcal.federation.local import LocalResult
from privfedcal.federation.workers import TrainJob
from privfedcal.privacy.release_journal import ReleaseJournal


class CountingTrainer:
    """Trains a client by drawing a fresh value each time (as DP-SGD's noise does)."""

    def __init__(self) -> None:
        self.trained: list[int] = []
        self.draws = 0

    def train(self, global_state, jobs, round_, consume=None):
        out = []
        for job in jobs:
            self.trained.append(job.client)
            self.draws += 1
            state = {"w": global_state["w"] + self.draws}
            if consume is not None:
                consume(state)
                state = {}
            out.append(LocalResult(state, None, None))
        return out

    def close(self):
        pass

    def terminate(self):
        pass


def jobs(*clients):
    return [TrainJob(c, torch.arange(2), None) for c in clients]


def test_a_redone_round_resends_journaled_updates_and_trains_only_the_others(tmp_path):
    journal = ReleaseJournal(tmp_path)
    glob = {"w": torch.zeros(2)}
    first = JournaledTrainer(CountingTrainer(), journal, "dpsgd")
    got: list[torch.Tensor] = []
    first.train(glob, jobs(0, 1, 2), 4, consume=lambda s: got.append(s["w"].clone()))
    journal.prune_through(3)  # an earlier checkpoint: round 4 stays
    (tmp_path / ReleaseJournal._name(4, "dpsgd", 1)).unlink()  # stopped before client 1's
    inner = CountingTrainer()
    again: list[torch.Tensor] = []
    JournaledTrainer(inner, journal, "dpsgd").train(
        glob, jobs(0, 1, 2), 4, consume=lambda s: again.append(s["w"].clone()))
    assert inner.trained == [1]  # clients 0 and 2 re-sent what they had sent
    assert torch.equal(again[0], got[0]) and torch.equal(again[2], got[2])
    assert not torch.equal(again[1], got[1])  # client 1's update had not left: a new draw
    assert journal.reused == 2


def test_without_consume_the_results_are_journaled_before_they_are_returned(tmp_path):
    journal = ReleaseJournal(tmp_path)
    results = JournaledTrainer(CountingTrainer(), journal, "dpsgd",
                               {"noise_multiplier": 1.0}).train({"w": torch.zeros(1)},
                                                                jobs(5), 1)
    kept, record = journal.get(1, "dpsgd", 5)
    assert torch.equal(kept["w"], results[0].state["w"])
    assert record["charge"] == {"noise_multiplier": 1.0}
