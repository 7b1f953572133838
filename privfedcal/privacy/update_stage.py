"""The stages of the model updates' uplink: the same idea as the calibration uploads' stages.

A round's model updates go from the clients to the server through the registered update
stages (privacy/stage_registry.py, entries with ``updates=True``), in client order: each
stage's ``client`` half runs on a client's update as it leaves the client, its ``server``
half (in reverse order) on the round's average where the server holds it in the clear. At
most one stage is the updates' wire (``wire``: it sums the updates itself, e.g. under CKKS,
privacy/secagg_updates.py); without one the updates reach the server in the clear and the
simulator averages them (``UpdateRound.clear``). A stage that must see the whole round to
protect it (DP-FedAvg, privacy/user_dp.py: clip, noise, a public denominator) ``takes`` the
round: its ``receive`` then trains and averages the round itself, through the wire where
there is one.

Every other hook has a default, so a stage overrides only what it does: ``open`` and
``close`` around the round (a budget check, a charge), ``attach_journal`` (a release kept for
resume), ``state_dict`` for resume, ``summary`` for ``summary.json``, and ``join``, called
once with all the run's update stages when the uplink is built (``join_stages``), where a
stage that adjusts another finds it (the adaptive clip hands itself to DP-FedAvg as the
policy that moves its clip, privacy/adaptive_clip.py). The uplink (privacy/uplink.py) runs
them without knowing what they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting
    from privfedcal.privacy.release_journal import ReleaseJournal
    from privfedcal.privacy.transcript import Transcript

State = dict[str, Tensor]
#: what receiving a round gives: (results, new average, update bytes sent, the results the
#: divergence check reads)
Received = tuple[list, State, int, list]


@dataclass
class UpdateRound:
    """One round's model updates as the update stages see them: the trainer and its jobs,
    the global state sent, the clients asked and their FedAvg weights, the server's record,
    the public local-training recipe it records with each update, and ``clear``: the
    simulator's own receipt in the clear (each update recorded as it arrives, then
    averaged), used where no stage sums the updates."""

    trainer: Any
    jobs: list
    global_state: State
    selected: list[int]
    weights: list[float]
    round_: int
    transcript: Transcript
    recipe: dict[str, Any] = field(default_factory=dict)
    clear: Callable[[UpdateRound], Received] | None = None
    client: int = -1  # the client whose half runs (client halves only)

    def at(self, client: int) -> UpdateRound:
        """The same round, seen by ``client``'s half."""
        return UpdateRound(self.trainer, self.jobs, self.global_state, self.selected,
                           self.weights, self.round_, self.transcript, self.recipe,
                           self.clear, client)


class UpdateStage:
    """One protection of the model updates (module docstring). ``name`` is its name in the
    stage registry and the key of its state in a checkpoint."""

    name: str = "update-stage"
    #: sums the updates itself: the server sees the round's updates only summed
    wire: bool = False
    #: receives the round itself (``receive``) rather than one update at a time
    takes: bool = False
    #: a checkpoint's top-level key that also holds this stage's state (read on resume)
    top_level_key: str | None = None

    def open(self, rnd: UpdateRound) -> None:
        """Server, before the round's clients train."""
        return None

    def client(self, state: State, rnd: UpdateRound) -> State:
        """Client ``rnd.client``: this layer applied to its trained state before it leaves."""
        return state

    def server(self, average: State, rnd: UpdateRound) -> State:
        """Server, on the round's average in the clear: this layer undone or completed."""
        return average

    def receive(self, rnd: UpdateRound, average: Callable[..., State] | None) -> Received:
        """A stage that ``takes`` the round: train it and average it (through ``average``,
        the wire's as the uplink runs it, where the run has a wire: None in the clear).
        The uplink refuses another stage with halves beside it (they would not run)."""
        raise NotImplementedError(f"update stage {self.name!r} does not receive a round")

    def average(self, sent: State, states: list[State], weights: list[float],
                clients: list[int], *, round_: int, transcript: Transcript) -> State:
        """A wire: the weighted average of ``states`` as the server obtains it."""
        raise NotImplementedError(f"update stage {self.name!r} is not a wire")

    def close(self, rnd: UpdateRound) -> None:
        """Server, after the round's average is made."""
        return None

    def records(self) -> tuple[list[dict], list[dict]]:
        """A wire: the uploads it rejected and the sums it skipped since last asked, moved
        out into the run's lists."""
        return [], []

    # run-level properties and hooks
    def join(self, stages: list[UpdateStage]) -> None:
        """Once the run's update stages are built (``stages``, in client order, this one
        among them): find the stages this one works with. Called again with the same stages,
        it changes nothing."""
        return None

    @property
    def has_halves(self) -> bool:
        """Whether this stage transforms updates (overrides ``client`` or ``server``)."""
        kind = type(self)
        return kind.client is not UpdateStage.client or kind.server is not UpdateStage.server

    @property
    def noises_updates(self) -> bool:
        """Whether this stage adds DP noise to the model updates (they are DP releases)."""
        return False

    @property
    def hides_loss(self) -> bool:
        """Whether a client's training loss is private under this stage (not reported)."""
        return False

    @property
    def accounting(self) -> DPAccounting | None:
        """The run's ``DPAccounting`` where this stage charges it."""
        return None

    def attach_journal(self, journal: ReleaseJournal, noised: bool) -> None:
        """Keep ``journal`` for this stage's DP releases (``noised``: some stage of the
        run noises the model updates)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """This stage's entries in the run's protection summary; a ``statement`` entry is
        appended to the run's statement."""
        return {}


def join_stages(stages: list[UpdateStage]) -> list[UpdateStage]:
    """Every stage's ``join`` with all of ``stages`` (client order); ``stages`` back."""
    for stage in stages:
        stage.join(stages)
    return stages


__all__ = ["Received", "State", "UpdateRound", "UpdateStage", "join_stages"]
