"""Secure aggregation of the model updates (``--secagg-updates``): the updates' CKKS wire.

Each client uploads ``w_k * state_k`` and its FedAvg weight ``w_k`` (``UPDATE_WEIGHT``)
through an uplink of its own whose one stage is the CKKS encrypt wire
(privacy/secagg_stage.py, sized by the planner's ``updates_plan``); the key holder
decrypts the sum only, and the server divides the summed states by the summed weight. The
server thus sees the round's aggregate and weight sum, never one client's update or size;
the guarantee holds provided the key holder does not collude with the server. A sum the key
holder refuses (too few uploads, a whole cohort missing, a weight sum that is not positive)
is not released: the global state stays as it was that round.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from privfedcal.errors import ReleaseSkipped
from privfedcal.privacy.reasons import Reason
from privfedcal.privacy.releases import UPDATE_RELEASE
from privfedcal.privacy.update_stage import State, UpdateStage

if TYPE_CHECKING:
    from privfedcal.privacy.plan import CKKSPlan
    from privfedcal.privacy.release_journal import ReleaseJournal
    from privfedcal.privacy.transcript import Transcript
    from privfedcal.privacy.uplink import Uplink

#: the extra entry of a securely aggregated model update: the client's FedAvg weight w_k,
#: summed with the weighted states so that the server can divide by the weight sum
UPDATE_WEIGHT = "__weight"

NAME = "secagg-updates"


class SecureUpdates(UpdateStage):
    """The model updates' wire: their CKKS sum (module docstring). ``uplink`` is its own
    uplink, the encrypt wire alone; ``seconds`` the wall time of each round's sum."""

    name = NAME
    wire = True
    top_level_key = "updates"

    def __init__(self, uplink: Uplink) -> None:
        self.uplink = uplink
        self.seconds: list[float] = []

    @classmethod
    def of(cls, plan: CKKSPlan) -> SecureUpdates:
        """The stage of ``plan`` (the planner's ``updates_plan``): fresh keys."""
        from privfedcal.privacy.secagg_stage import CKKSSettings, EncryptStage
        from privfedcal.privacy.uplink import Uplink

        return cls(Uplink(stages=[EncryptStage(CKKSSettings.from_plan(plan, dp=None))]))

    def average(self, sent: State, states: list[State], weights: list[float],
                clients: list[int], *, round_: int, transcript: Transcript) -> State:
        """The round's weighted average as the server obtains it, from the CKKS sum of
        ``w_k * state_k`` and ``w_k`` (ciphertext sizes and the aggregate recorded); an
        aggregate that fails the key holder's check leaves the global state ``sent``."""
        t0 = time.perf_counter()
        keys = [k for k, v in sent.items() if v.is_floating_point()]
        uploads = [(int(c), {UPDATE_WEIGHT: torch.tensor([float(w)], dtype=torch.float64),
                             **{k: st[k].detach().double().cpu() * float(w) for k in keys}})
                   for c, st, w in zip(clients, states, weights, strict=True)]
        try:
            total = self.uplink.aggregate(uploads, round_=round_, label=UPDATE_RELEASE,
                                          transcript=transcript)
            weight = float(total.pop(UPDATE_WEIGHT)[0])
            if not weight > 0:
                self.uplink.raise_skipped(round_, UPDATE_RELEASE, Reason.WEIGHT_NOT_POSITIVE,
                                          f"decrypted weight sum {weight:g}")
        except ReleaseSkipped:  # recorded by its uplink; the global state stays
            return dict(sent)
        out = {k: v.clone() for k, v in sent.items()}  # integer buffers: the global ones
        for k in keys:
            out[k] = (total[k] / weight).to(sent[k].dtype).to(sent[k].device)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def records(self) -> tuple[list[dict], list[dict]]:
        """The uploads its uplink rejected and the sums it skipped since last asked, moved
        out (the run lists every uplink's records together, once)."""
        out = (self.uplink.rejected, self.uplink.skipped)
        self.uplink.rejected, self.uplink.skipped = [], []
        return out

    def attach_journal(self, journal: ReleaseJournal, noised: bool) -> None:
        if noised:  # its uploads are DP releases (DP-SGD's or DP-FedAvg's noise)
            self.uplink.journal = journal

    def state_dict(self) -> dict[str, Any]:
        return self.uplink.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.uplink.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        n = len(self.seconds)
        return {"secagg_updates": {
            "model_updates": "CKKS sums of weighted updates and weights; the server sees "
                             "the aggregate and the summed weight only",
            **self.uplink.wire.summary().get("secagg", {}), "rounds": n,
            "mean_seconds_per_round": round(sum(self.seconds) / n, 4) if n else None}}


__all__ = ["NAME", "UPDATE_WEIGHT", "SecureUpdates"]
