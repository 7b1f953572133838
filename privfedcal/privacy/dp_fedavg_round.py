"""One round of DP-FedAvg as the server receives it: each update clipped as it arrives,
summed (in the clear, or through the updates' CKKS wire), noised and divided by the public
denominator.

``receive_round`` runs the round for the DP-FedAvg stage (privacy/user_dp.py ``UserDP``,
which supplies the clip, the noise, the journal and the charge: ``RoundStage`` names what
the round uses of it). In the clear, the round holds one client's update at a time besides
the running sum (``_sum_in_clear``); under ``--secagg-updates`` every clipped update, its
noise share included, goes through the wire's average, which the server sees only summed
(``_sum_securely``). No training loss leaves a client, and a non-finite local model is
reported to the divergence check and not summed. After the sum a clip policy, where the run
has one (``ClipPolicy``: the adaptive clip, privacy/adaptive_clip.py), moves the clip for
the next round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from privfedcal.privacy.releases import UPDATE_RELEASE
from privfedcal.privacy.transcript import Transcript, record_model_updates
from privfedcal.privacy.update_stage import Received, State
from privfedcal.privacy.update_vectors import UpdateLayout, vector_norm
from privfedcal.tensors import nonfinite_key


class RoundStage(Protocol):
    """What a round's receipt and a clip policy use of the DP-FedAvg stage
    (privacy/user_dp.py ``UserDP``): its settings and noise multipliers, its budget check
    and charge, its clip (and noise share), its journal, its server noise, the new global
    state, and the clip's move after the round."""

    label: str
    distributed: bool
    clip: float
    initial_clip: float
    denominator: int
    seed: int
    seeded: bool

    @property
    def noise_multiplier(self) -> float: ...

    @property
    def update_multiplier(self) -> float: ...

    def admit_round(self, clients: list[int]) -> None: ...

    def draw_ahead(self, n: int, round_: int) -> None: ...

    def charge_round(self, clients: list[int]) -> None: ...

    def clip_and_share(self, delta: Tensor, norm: float, round_: int, client: int,
                       participants: int | None = None) -> bool: ...

    def released(self, round_: int, label: str, party: int | str, value: Tensor
                 ) -> Tensor: ...

    def add_server_noise(self, total: Tensor, round_: int) -> None: ...

    def apply(self, global_state: State, layout: UpdateLayout, base: Tensor,
              total: Tensor) -> State: ...

    def adapt(self, within: int, round_: int) -> None: ...


class ClipPolicy(Protocol):
    """What moves DP-FedAvg's clip between rounds (a stage's ``join`` hands it to
    ``UserDP.use_clip_policy``, privacy/user_dp.py). Each round it may release a noised
    statistic of its own beside the sum (through ``released``, journaled and charged with
    it): the two releases together are one Gaussian mechanism of the planned multiplier
    ``z``, so the charge is unchanged and the sum's own multiplier grows. Its hooks:
    ``check`` refuses (``SettingError``) a DP-FedAvg it cannot move; ``count_std``, the std
    of the noise on its own release; ``update_multiplier``, the sum's multiplier beside it;
    ``moved_clip``, the next round's clip from the number of the round's updates within the
    clip (the server, after the sum); ``clip_summary`` and ``describe``, its entry in the
    ``user_dp`` summary and the clip in the statement's words."""

    def check(self, stage: RoundStage) -> None: ...

    def count_std(self, stage: RoundStage) -> float: ...

    def update_multiplier(self, stage: RoundStage) -> float: ...

    def moved_clip(self, stage: RoundStage, within: int, round_: int) -> float: ...

    def clip_summary(self, stage: RoundStage) -> dict[str, Any]: ...

    def describe(self, stage: RoundStage) -> str: ...


def receive_round(stage: RoundStage, trainer: Any, jobs: list, global_state: State,
                  selected: list[int], round_: int, transcript: Transcript,
                  recipe: dict[str, Any], secure_average: Callable[..., State] | None
                  ) -> Received:
    """One round under DP-FedAvg: returns (results, new global state, bytes uploaded,
    results for the divergence check). No training loss leaves a client (it is
    data-dependent); a non-finite local model is reported by the divergence check and
    not summed. ``secure_average`` is the updates' wire's average
    (``Uplink.average_updates``) under --secagg-updates, else None."""
    stage.admit_round(selected)
    layout = UpdateLayout(global_state)
    # float64, as every update below
    uploads = _RoundUploads(stage, layout, layout.flatten(global_state), selected, round_)
    if secure_average is None:
        stage.draw_ahead(layout.numel, round_)  # the server's noise, while the clients train
        results, new = _sum_in_clear(stage, trainer, jobs, global_state, uploads,
                                     transcript, recipe)
    else:
        results, new = _sum_securely(stage, trainer, jobs, global_state, uploads,
                                     transcript, secure_average)
    stage.charge_round(selected)
    stage.adapt(uploads.within, round_)
    results = [r._replace(loss=None) for r in results]
    checked = [r._replace(state=m) for r, m in zip(results, uploads.markers, strict=True)]
    return results, new, uploads.sent_bytes, checked


def _sum_in_clear(stage: RoundStage, trainer: Any, jobs: list, global_state: State,
                  uploads: _RoundUploads, transcript: Transcript,
                  recipe: dict[str, Any]) -> tuple[list, State]:
    """Each clipped update summed as it arrives (one client's at a time in memory),
    the server's noise added to the sum: (results, new global state)."""
    layout, base, selected, round_ = (uploads.layout, uploads.base, uploads.selected,
                                      uploads.round_)
    total = torch.zeros_like(base)  # the sum of the clipped updates
    work = torch.empty_like(base)  # one client's update at a time
    seen_flat = torch.empty_like(base)
    summed = 0

    def consume(state: State) -> None:
        nonlocal summed
        delta = uploads.take(state, work)
        if delta is None:
            return
        # what the server receives: the global state moved by the clipped update
        # (integer buffers are not sent: the global ones, for a complete state)
        seen = {**global_state,
                **layout.unflatten(torch.add(base, delta, out=seen_flat), cast=True)}
        record_model_updates(transcript, round_, [selected[len(uploads.markers) - 1]],
                             [seen], [1.0], recipe)
        total.add_(delta)
        summed += 1

    results = trainer.train(global_state, jobs, round_, consume=consume)
    if not summed:
        return results, dict(global_state)
    stage.add_server_noise(total, round_)
    return results, stage.apply(global_state, layout, base, total)


def _sum_securely(stage: RoundStage, trainer: Any, jobs: list, global_state: State,
                  uploads: _RoundUploads, transcript: Transcript,
                  secure_average: Callable[..., State]) -> tuple[list, State]:
    """--secagg-updates: every clipped update (noise share included) through the
    uplink's CKKS average, which the server sees only summed: (results, new state). A
    sum holds whole cohorts only, so a cohort left out (an upload rejected) leaves fewer
    contributors than uploads, and a withheld sum (the whole-run check) none: the global
    state then stays."""
    layout, base, selected, round_ = (uploads.layout, uploads.base, uploads.selected,
                                      uploads.round_)
    results = trainer.train(global_state, jobs, round_)
    deltas = [uploads.take(r.state, None) for r in results]
    if any(d is None for d in deltas):  # the divergence check stops the run
        return results, dict(global_state)
    sent = [layout.unflatten(base + d, cast=True) for d in deltas]  # type: ignore[operator]
    before = len(transcript.entries)
    avg = secure_average(global_state, sent, [1.0] * len(sent), selected,
                         round_=round_, transcript=transcript)
    summed = [int(e["clients"]) for e in transcript.entries[before:]
              if e["view"] == "aggregate" and e["label"] == UPDATE_RELEASE]
    if not summed:  # withheld or skipped: nothing was released this round
        return results, dict(global_state)
    # the secure average divides by the uploads summed (its contributors); DP-FedAvg by m
    total = layout.flatten(avg).sub_(base).mul_(summed[-1])
    return results, stage.apply(global_state, layout, base, total)


@dataclass
class _RoundUploads:
    """One round's DP-FedAvg uploads as they arrive: each client's update clipped (and its
    noise share added) against ``base``, the flat global state; what the round reports
    (the divergence check's markers, the bytes sent, the clients within the clip)."""

    dp: RoundStage
    layout: UpdateLayout
    base: Tensor
    selected: list[int]
    round_: int
    markers: list[State] = field(default_factory=list)
    sent_bytes: int = 0
    within: int = 0

    def take(self, state: State, out: Tensor | None) -> Tensor | None:
        """The client's clipped update (noise share included) as a flat float64 vector,
        or None for a non-finite local model (then its marker names the entry)."""
        i = len(self.markers)
        self.sent_bytes += sum(v.numel() * v.element_size() for v in state.values())
        delta = self.layout.flatten(state, out).sub_(self.base)
        norm = vector_norm(delta)
        bad = None if math.isfinite(norm) else nonfinite_key(state)
        self.markers.append({} if bad is None else {bad: torch.tensor(float("nan"))})
        if bad is not None:
            return None
        client = self.selected[i]
        self.within += int(self.dp.clip_and_share(delta, norm, self.round_, client,
                                                  len(self.selected)))
        if self.dp.distributed:  # its noise share drawn: what it sends, once
            delta.copy_(self.dp.released(self.round_, self.dp.label, client, delta))
        return delta


__all__ = ["ClipPolicy", "RoundStage", "receive_round"]
