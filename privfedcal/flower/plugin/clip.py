"""``dp-clip = "auto"`` under the plugin: the feature clip chosen by the nodes' noisy norm
histograms (``privacy/quantile.py``), before the calibration release, within the run's
epsilon.

The run's budget (epsilon, delta) is split by basic composition: the clip's search takes
``ClipSearch.share`` of epsilon and half of delta, the calibration release the rest (its
``DPStage`` plans and accounts for that rest, as for a given clip). The search is one
Gaussian release per node at q = 1, split into two stages whose RDP adds up to that one
release (``ClipSearch.stage_sigmas``): each node sends a histogram of its feature norms
under the server's model over a public grid, with its own noise from OS entropy, at most
once per stage (its ledger in ``context.state``); the server sums them, locates the median
(stage 1), then estimates the target quantile on a finer grid around it (stage 2), and sends
the clip to the nodes (stage 3), which then clip and noise their calibration upload with
it. A node computes every grid itself from the public search parameters and, for stage 2,
the server's first estimate; it takes the clip from the server's message, checked to lie in
the search's range: any clip keeps the guarantee, since the release's noise is scaled to the
clip it uses (its sensitivities are R and R^2), and a bad clip only costs accuracy.
The guarantee of the whole run: (epsilon_clip + epsilon_spent, delta_clip + delta) of the
calibration, within the run's target; it does not hold for a node that reports norms other
than those of the data it then uploads from (quantile.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.quantile import QUANTILE_RELEASE, ClipSearch, check_edges

__all__ = ["AUTO", "CLIP_MESSAGE", "CLIP_STATE", "AutoClip"]

AUTO = "auto"
#: the message of the clip's stages (``config``: stage, and centre or clip)
CLIP_MESSAGE = "query.clip"
#: a node's record of the clip: the stages it released and the clip it was sent
CLIP_STATE = "privfedcal.clip"
STAGES = (1, 2)


@dataclass(frozen=True)
class AutoClip:
    """The clip's search and its share of the budget: ``epsilon``, ``delta`` and the
    noise multiplier ``sigma`` of its one (two-stage) release."""

    search: ClipSearch
    epsilon: float
    delta: float
    sigma: float

    @classmethod
    def plan(cls, epsilon: float, delta: float, accountant: str) -> AutoClip:
        search = ClipSearch()
        eps, dlt = search.share * epsilon, delta / 2
        (sigma,) = plan_noise(eps, dlt, [ReleasePlan(QUANTILE_RELEASE, 1.0, 1)], accountant)
        return cls(search, eps, dlt, sigma)

    def stage_sigma(self, stage: int) -> float:
        return self.search.stage_sigmas(self.sigma)[stage - 1]

    def edges(self, stage: int, centre: float | None = None) -> Tensor:
        """The grid of ``stage``: public, or around the server's first estimate."""
        if stage == 1:
            return self.search.first_edges()
        if centre is None or not (math.isfinite(centre) and centre > 0):
            raise UsageError(f"clip stage 2 needs a finite centre > 0, got {centre!r}")
        return check_edges(self.search.fine_edges(float(centre)))

    def check_clip(self, clip: Any) -> float:
        """The clip a node accepts: a finite number inside the search's range."""
        if isinstance(clip, bool) or not isinstance(clip, int | float) \
                or not self.search.low <= clip <= self.search.high:
            raise UsageError(f"the clip must be a number in [{self.search.low:g}, "
                             f"{self.search.high:g}], got {clip!r}")
        return float(clip)

    def summary(self, clip: float, centre: float, calibration_spent: float | None,
                calibration_delta: float | None) -> dict[str, Any]:
        out = {"clip": clip, "median_estimate": centre, "quantile": self.search.quantile,
               "epsilon": self.epsilon, "delta": self.delta, "noise_multiplier": self.sigma,
               "composition": "basic: the clip's (epsilon, delta) plus the calibration's"}
        if calibration_spent is not None and calibration_delta is not None:
            out["run_epsilon"] = self.epsilon + calibration_spent
            out["run_delta"] = self.delta + calibration_delta
        return out


def histogram_total(histograms: dict[int, Tensor], bins: int) -> tuple[Tensor, list[int]]:
    """The sum of the well-formed histograms (``bins`` finite counts) and the clients whose
    histogram was malformed (dropped)."""
    total = torch.zeros(bins, dtype=torch.float64)
    bad = []
    for client, h in sorted(histograms.items()):
        h = torch.as_tensor(h)
        if h.shape != (bins,) or not bool(torch.isfinite(h).all()):
            bad.append(client)
            continue
        total += h.double()
    return total, bad


@dataclass
class ClipOutcome:
    """What the server's search found and saw: the clip, the first stage's estimate, the
    histograms it summed (stage -> client -> counts) and its notes (lost or malformed)."""

    clip: float
    centre: float
    histograms: dict[int, dict[int, Tensor]]
    notes: list[str]


def choose_clip(link: Any, state: dict[str, Tensor], auto: AutoClip, sizes: dict[int, int],
                need: int | None) -> ClipOutcome:
    """The server's half of the search over ``link``: the two stages and the clip sent
    back. A lost node, or one whose histogram is malformed or non-finite, is left out and
    named (the quantile then counts the others' reported sizes); fewer than ``need``
    replies stop the run (``GridLink.exchange``)."""
    from flwr.app import ConfigRecord, RecordDict

    from privfedcal.flower.records import record_to_state, state_to_record
    from privfedcal.privacy.quantile import quantile_from_histogram

    clients = sorted(sizes)
    model = state_to_record(state)
    seen: dict[int, dict[int, Tensor]] = {}
    notes: list[str] = []
    centre = clip = 0.0
    for stage, quantile in ((1, auto.search.locate_quantile), (2, auto.search.quantile)):
        edges = auto.edges(stage, None if stage == 1 else centre)
        config = {"stage": stage} if stage == 1 else {"stage": stage, "centre": centre}
        replies = link.exchange(RecordDict({"state": model, "config": ConfigRecord(config)}),
                                clients, CLIP_MESSAGE, f"clip-{stage}", need=need)
        got: dict[int, Tensor] = {}
        for client, reply in replies.items():
            try:
                got[client] = record_to_state(reply.content["histogram"])["counts"]
            except (KeyError, ValueError):  # no histogram, or not plain numbers
                got[client] = torch.full((0,), math.nan)
        total, bad = histogram_total(got, edges.numel() + 1)
        lost = [c for c in clients if c not in replies]
        if bad or lost:
            notes.append(f"clip stage {stage}: client(s) {lost + bad} left out (lost: {lost}, "
                         f"malformed histogram: {bad})")
        kept = [c for c in got if c not in bad]
        if not kept:
            raise UsageError(f"clip stage {stage}: no node sent a well-formed histogram")
        seen[stage] = {c: got[c] for c in kept}
        value = quantile_from_histogram(total, edges, quantile,
                                        num_examples=sum(sizes[c] for c in kept))
        if stage == 1:
            centre = value
        else:
            clip = value
    link.exchange(RecordDict({"config": ConfigRecord({"stage": 3, "clip": clip})}), clients,
                  CLIP_MESSAGE, "clip-3", need=need)
    return ClipOutcome(clip, centre, seen, notes)
