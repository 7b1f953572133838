"""The model updates' side of the uplink: the update stages (privacy/update_stage.py) run
the way the calibration uploads' stages do.

Client halves run in order on each update, server halves in reverse on the average, at most
one wire sums the updates; state, journal and summary go through the same hooks as the
uploads' stages: DP-FedAvg (privacy/user_dp.py), their CKKS sum (privacy/secagg_updates.py),
or an extension's, each registered in the stage registry. ``Uplink`` (privacy/uplink.py)
takes these methods from ``UpdatePath``, and the rejected uploads and skipped sums of the
updates' wire join its own lists, so every rejection of the run is listed together.
"""

from __future__ import annotations

from typing import Any

from privfedcal.privacy.stages import Stage
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.update_stage import Received, State, UpdateRound, UpdateStage


class UpdatePath:
    """The model updates' half of ``Uplink``: FedAvg weights, the update stages' halves
    around a round, the updates' wire. It reads the uplink's stages and ``hide_counts``
    and adds to its ``rejected`` and ``skipped`` lists."""

    stages: list[Stage]
    update_stages: list[UpdateStage]
    hide_counts: bool
    rejected: list[dict]
    skipped: list[dict]

    def update_weights(self, sizes: list[float]) -> list[float]:
        """FedAvg weights of a round: client sizes n_k, except where the sizes are private
        data: uniform (public nominal) weights, so no size leaves a client. Sizes are
        private under --dp-train, and under --hide-counts with updates in the clear (a
        size is the total of the client's hidden class counts: with a cohort's determined
        sums it splits them, ``count_splits.py``); where an update stage sums the updates
        (its wire) they travel inside the sum."""
        if self.nominal_weights:
            return [1.0] * len(sizes)
        return list(sizes)

    @property
    def nominal_weights(self) -> bool:
        """Whether model updates are averaged with uniform public weights."""
        return (any(s.uniform_weights for s in self.stages)
                or (self.hide_counts and not self.hides_updates))

    @property
    def hides_updates(self) -> bool:
        """Whether the server sees the model updates only summed (an update wire)."""
        return self.update_wire is not None

    @property
    def update_wire(self) -> UpdateStage | None:
        return next((s for s in self.update_stages if s.wire), None)

    @property
    def hides_loss(self) -> bool:
        """Whether a client's training loss stays on the client (an update stage says so)."""
        return any(s.hides_loss for s in self.update_stages)

    def update_client(self, state: State, rnd: UpdateRound) -> State:
        """Client ``rnd.client``: the update stages' client halves in order on its state."""
        for stage in self.update_stages:
            state = stage.client(state, rnd)
        return state

    def update_server(self, average: State, rnd: UpdateRound) -> State:
        """Server: the update stages' server halves in reverse order on the average."""
        for stage in reversed(self.update_stages):
            average = stage.server(average, rnd)
        return average

    def receive_updates(self, rnd: UpdateRound) -> Received:
        """The round's model updates through the update stages: every ``open``; then the
        stage that takes the round receives it, or the updates are trained, put through
        the client halves and summed by the wire, or (no wire) received in the clear by
        ``rnd.clear``; the server halves on the average; every ``close``."""
        for stage in self.update_stages:
            stage.open(rnd)
        taker = next((s for s in self.update_stages if s.takes), None)
        if taker is not None:
            results, average, sent_bytes, checked = taker.receive(
                rnd, self.average_updates if self.hides_updates else None)
        elif self.update_wire is not None:
            results = rnd.trainer.train(rnd.global_state, rnd.jobs, rnd.round_)
            sent_bytes = sum(sum(v.numel() * v.element_size() for v in r.state.values())
                             for r in results)
            states = [self.update_client(r.state, rnd.at(c))
                      for c, r in zip(rnd.selected, results, strict=True)]
            average = self.average_updates(rnd.global_state, states, rnd.weights,
                                           rnd.selected, round_=rnd.round_,
                                           transcript=rnd.transcript)
            checked = results
        else:
            assert rnd.clear is not None, "updates in the clear need the simulator's receipt"
            results, average, sent_bytes, checked = rnd.clear(rnd)
        if taker is None:
            average = self.update_server(average, rnd)
        for stage in self.update_stages:
            stage.close(rnd)
        return results, average, sent_bytes, checked

    def average_updates(self, sent: State, states: list[State], weights: list[float],
                        clients: list[int], *, round_: int, transcript: Transcript) -> State:
        """The round's weighted average as the update wire gives it to the server (its
        rejected uploads and skipped sums moved into this uplink's lists)."""
        wire = self.update_wire
        if wire is None:
            raise RuntimeError("this uplink has no wire of the model updates: the simulator "
                               "averages updates in the clear itself")
        try:
            return wire.average(sent, states, weights, clients, round_=round_,
                                transcript=transcript)
        finally:  # its records are the run's: every uplink's rejections listed together
            rejected, skipped = wire.records()
            self.rejected += rejected
            self.skipped += skipped

    @staticmethod
    def recipe(spec) -> dict[str, Any]:
        """The public local-training recipe (the run's resolved ``LocalSpec``) the transcript
        records with each update."""
        return {"local_epochs": spec.training.local_epochs, "batch_size": spec.training.batch_size,
                "lr": spec.training.lr}


__all__ = ["UpdatePath"]
