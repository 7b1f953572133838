"""``dp-clip = "auto"`` under the plugin: the feature clip chosen by the nodes' noisy norm
histograms (``privacy/quantile.py``), before the calibration release, within the run's one
epsilon.

The run's budget (epsilon, delta) is planned once for the clip's search and the calibration
releases together (``quantile.plan_clip_noise``: the clip's release is calibrated alone to
``ClipSearch.share`` of epsilon, the calibration releases take the smallest noise for which
the RDP composition of everything stays within epsilon, at the run's delta). Both sides
derive that plan from the shared settings (``plugin_settings.resolve``) and hand it to the
protection planner (``AutoClip.preset``, privacy/plan.py ``PresetNoise``), so the server's
per-client accountants,
each node's noise and the summary's ``epsilon_target`` / ``epsilon_spent`` cover the whole
run. The search is one Gaussian release per node at q = 1, split into two stages whose RDP
adds up to that one release (``ClipSearch.stage_sigmas``): each node sends a histogram of its
feature norms under the server's model over a public grid, with its own noise from OS
entropy, drawn once per stage (its record in ``context.state``, re-sent if asked again:
``kept_histogram``); the server sums them,
locates the median (stage 1), then estimates the target quantile on a finer grid around it
(stage 2), and sends the clip to the nodes (stage 3), which then clip and noise their
calibration upload with it. A node computes every grid itself from the public search
parameters and, for stage 2, the server's first estimate; it takes the clip from the
server's message, checked to lie in the search's range: any clip keeps the guarantee, since
the release's noise is scaled to the clip it uses (its sensitivities are R and R^2), and a
bad clip only costs accuracy. Likewise a node that reports false norms can only move the
clip (accuracy), never weaken the guarantee: the histograms are noised at sensitivity 1
whatever the norms, and every feature is clipped to the public clip before release.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from privfedcal.errors import BudgetRefused, PrivacyBudgetError, UsageError
from privfedcal.privacy.accounting import ReleasePlan
from privfedcal.privacy.plan import PresetNoise
from privfedcal.privacy.quantile import (
    QUANTILE_RELEASE,
    ClipSearch,
    check_edges,
    plan_clip_noise,
)

if TYPE_CHECKING:
    from flwr.app.typing import ConfigRecordValues

__all__ = ["AUTO", "CLIP_MESSAGE", "CLIP_STATE", "AutoClip", "default_clip", "keep_histogram",
           "kept_histogram", "stage_label", "with_update_release"]

AUTO = "auto"
#: the message of the clip's stages (``config``: stage, and centre or clip)
CLIP_MESSAGE = "query.clip"
#: a node's record of the clip: the stages it released and the clip it was sent
CLIP_STATE = "privfedcal.clip"
STAGES = (1, 2)


def default_clip(flat: dict[str, Any], dp_on: bool) -> dict[str, Any]:
    """``flat`` with ``dp-clip = "auto"`` where DP is on and no clip is set: in a user's app
    no fixed number fits every model (feature norms differ by orders of magnitude between
    networks), so the nodes' private search chooses it within the run's one budget unless
    the user gives one. Both sides resolve the same settings, so both take the default."""
    if dp_on and flat.get("dp-clip") is None:
        return {**flat, "dp-clip": AUTO}
    return flat


def with_update_release(inputs: Any, releases: list[ReleasePlan]) -> list[ReleasePlan]:
    """``releases`` and, under ``dp-updates`` (a strategy wrapped in ``PrivateUpdates``,
    dp_fedavg.py), DP-FedAvg's rounds as the planner adds them (``protection.noise_plan``),
    so that the search's one plan covers every release of the run. ``inputs``: the
    planner's ``ProtectionInputs``."""
    p = inputs.privacy
    if not p.dp_updates:
        return releases
    from privfedcal.privacy.planner import participation_counts
    from privfedcal.privacy.user_dp import release_plan

    steps = max(participation_counts(p).values())
    return [*releases, release_plan(steps, p.dp_updates_share if releases else None)]


@dataclass(frozen=True)
class AutoClip:
    """The clip's search and the run's one noise plan (``plan_clip_noise``): the run's
    ``epsilon`` and ``delta``, the noise multiplier ``sigma`` of the search's one
    (two-stage) release and ``calibration``, the multiplier of each calibration release."""

    search: ClipSearch
    epsilon: float
    delta: float
    sigma: float
    calibration: dict[str, float]

    @classmethod
    def plan(cls, epsilon: float, delta: float, accountant: str,
             releases: Sequence[ReleasePlan]) -> AutoClip:
        """The plan for the run's target (``epsilon``, ``delta``) and its calibration
        ``releases`` (``protection.release_plans``)."""
        search = ClipSearch()
        try:
            sigma, sigmas = plan_clip_noise(epsilon, delta, search, releases, accountant)
        except PrivacyBudgetError as exc:  # the search's share is below the accountant's reach
            raise UsageError(
                f"the feature clip's private search cannot be planned at dp-eps {epsilon:g} "
                f"(its share, epsilon {search.share * epsilon:g} at delta {delta:g}, is "
                "below what the accountant reaches): set privfedcal.dp-clip to a number "
                "(dp_clip= as a keyword)") from exc
        return cls(search, epsilon, delta, sigma,
                   {p.name: z for p, z in zip(releases, sigmas, strict=True)})

    @property
    def search_epsilon(self) -> float:
        """The search's epsilon alone (its share of the target, as planned)."""
        return self.search.share * self.epsilon

    def stage_sigma(self, stage: int) -> float:
        return self.search.stage_sigmas(self.sigma)[stage - 1]

    def preset(self) -> PresetNoise:
        """This plan as the protection planner takes it (``protection_inputs``'s
        ``preset``): the calibration releases' multipliers, and the search's two stages as
        planned releases (q = 1, once each) that the accountants are charged for; the
        planner refuses it for other releases or another budget."""
        return PresetNoise(self.epsilon, self.delta, dict(self.calibration),
                           tuple((stage_label(s), self.stage_sigma(s), 1.0, 1) for s in STAGES))

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

    def summary(self, clip: float, centre: float, run_spent: float | None) -> dict[str, Any]:
        """The summary's record of the search; ``run_spent``: the run's epsilon_spent (the
        search's stages and the calibration in one accountant)."""
        out = {"clip": clip, "median_estimate": centre, "quantile": self.search.quantile,
               "epsilon": self.search_epsilon, "delta": self.delta,
               "noise_multiplier": self.sigma,
               "composition": "RDP: the search's two stages and the calibration releases "
                              "in one accountant, within the run's epsilon"}
        if run_spent is not None:
            out["run_epsilon"] = run_spent
            out["run_delta"] = self.delta
        return out


def kept_histogram(record: dict[str, Any], stage: int, centre: Any) -> Tensor | None:
    """The noisy histogram this node released for ``stage`` (its record in
    ``context.state``), to send again when the server asks the same stage again (a server
    restarted within the run): a release is re-sent, never redrawn. None where it has not
    released the stage. A repeated stage 2 around another centre would be a new release
    on another grid: refused (``BudgetRefused``)."""
    made = [int(x) for x in str(record.get("stages", "")).split(",") if x]
    if stage not in made:
        return None
    kept = record.get(f"histogram-{stage}")
    if kept is None or (stage != 1 and record.get(f"centre-{stage}") != centre):
        raise BudgetRefused(f"this node has released its stage-{stage} norm histogram "
                            "already: refusing another")
    return torch.tensor(list(kept), dtype=torch.float64)


def keep_histogram(record: dict[str, Any], stage: int, centre: Any,
                   histogram: Tensor) -> dict[str, Any]:
    """``record`` with ``stage``'s release added: the stage, its noisy histogram and the
    centre it was asked around (kept before the reply leaves the node)."""
    made = [int(x) for x in str(record.get("stages", "")).split(",") if x]
    out = {**record, "stages": ",".join(map(str, [*made, stage])),
           f"histogram-{stage}": [float(v) for v in histogram.double().tolist()]}
    if centre is not None:
        out[f"centre-{stage}"] = float(centre)
    return out


def stage_label(stage: int) -> str:
    """The accountant's label of the search's ``stage`` (1 or 2)."""
    return f"{QUANTILE_RELEASE}/{stage}"


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
        config: dict[str, ConfigRecordValues] = ({"stage": stage} if stage == 1
                                                 else {"stage": stage, "centre": centre})
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
