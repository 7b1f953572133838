"""The feature clip's channel of ``privfedcal audit dp``: the noisy norm histograms of the
Flower plugin's ``dp-clip = "auto"`` search (``privacy/quantile.py``).

The game (``attacks/distinguishing/games.py``): D is a client's feature norms, D' the same with one more
sample (sample-level adjacency, as every calibration release). Whatever its norm, the
canary adds 1 to one bin of each stage's histogram (sensitivity 1), so the view is that bin
in each of the two stages; the other bins carry the same counts in D and D' and independent
noise, weight zero in the projection test, so they are left out. The stages' noise differs
(``ClipSearch.stage_sigmas``), and the projection score weights each by its own variance.

The release is the real code: ``noisy_norm_histogram`` at each stage's planned multiplier,
noise from OS entropy. The bins of one call are independent Gaussian draws, so one call over
a grid of k edges plays k + 1 trials at once: trial t's norms fall in bin t (a few samples of
D in every bin), and D' puts its canary in every bin, each trial reading its own.
The plan is the plugin's for this configuration (``plan_clip_noise`` for the run's epsilon,
delta and calibration releases); the claim is the accountant's charge for the two stages
alone, i.e. one Gaussian release at the search's multiplier (``search.share`` of epsilon).
"""

from __future__ import annotations

import torch

from privfedcal.attacks.distinguishing.games import Channel, Views
from privfedcal.privacy import quantile
from privfedcal.privacy.accounting import compute_epsilon
from privfedcal.privacy.quantile import MAX_BINS, QUANTILE_RELEASE, ClipSearch, plan_clip_noise

#: the client fields (privacy/client_fields.py) the view carries
FIELDS = ("query.clip/histogram/counts",)
#: samples of D in every trial's bin (any count: the canary moves it by 1 either way)
BASE_COUNT = 3


def clip_plan(cfg, calibrator, dp) -> tuple[float, float]:
    """(the search's multiplier, delta) as the plugin plans ``cfg``'s budget: the run's
    epsilon and delta (``dp``, its planned noise stage) and calibration releases."""
    from privfedcal.privacy.planner import protection_inputs, release_plans
    from privfedcal.settings.floors import PrivacyOptions

    plans = release_plans(protection_inputs(PrivacyOptions.of(cfg), calibrator))
    z, _ = plan_clip_noise(cfg.privacy.dp_eps, dp.delta, ClipSearch(), plans, dp.accountant.kind)
    return z, dp.delta


def clip_channel(cfg, calibrator, plan, noise_scale: float = 1.0) -> Channel:
    """The channel of the clip's search for ``cfg``; ``plan`` is the run's correct noise
    stage, ``noise_scale`` a fault (the noise scaled; the claim stays the correct run's)."""
    search = ClipSearch()
    z, delta = clip_plan(cfg, calibrator, plan.dp)
    stages = search.stage_sigmas(z)
    claim = compute_epsilon([(s, 1.0, 1) for s in stages], plan.dp.accountant.kind, delta)
    per_call = MAX_BINS - 1  # bins of one call: one trial each

    def stage_views(n: int, sigma: float, with_canary: bool) -> torch.Tensor:
        out = []
        for start in range(0, n, per_call):
            k = min(per_call, n - start)
            edges = torch.arange(1, k, dtype=torch.float64) if k > 1 else \
                torch.ones(1, dtype=torch.float64)
            # norm t + 0.5 lies in bin t: (-inf, 1], (1, 2], ..., (k - 1, inf)
            norms = (torch.arange(k, dtype=torch.float64) + 0.5).repeat(
                BASE_COUNT + int(with_canary))
            h = quantile.noisy_norm_histogram(norms, edges, sigma * noise_scale)
            out.append(h[:k])
        return torch.cat(out).unsqueeze(1)

    def draw(n: int, with_canary: bool) -> Views:
        return {f"stage{i}": stage_views(n, s, with_canary)
                for i, s in enumerate(stages, start=1)}

    base = torch.full((1, 1), float(BASE_COUNT), dtype=torch.float64)
    reference = ({f"stage{i}": base for i in (1, 2)},
                 {f"stage{i}": base + 1.0 for i in (1, 2)})
    return Channel(QUANTILE_RELEASE, FIELDS, claim, delta,
                   "one more sample (its norm's bin +1), both search stages", draw,
                   reference=reference)


__all__ = ["BASE_COUNT", "FIELDS", "clip_channel", "clip_plan"]
