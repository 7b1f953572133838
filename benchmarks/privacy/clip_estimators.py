"""Private quantile estimators for the feature clip, at equal budget, on synthetic norms.

    python benchmarks/privacy/clip_estimators.py [--draws 30] [--eps 0.8,8] [--sd 0.3]

10 clients x 200 samples of log-normal norms (log-sd ``--sd``) whose scale is drawn
log-uniformly in [0.5, 200]; every estimator spends the budget of ONE Gaussian release of
multiplier z at q = 1 (planned by ``plan_noise`` for each epsilon), split between its steps
so that their RDP adds up to it (T steps of z sqrt(T), or z / sqrt(w) and z / sqrt(1 - w)):

* ``one-stage``: one noisy histogram over the whole public grid [0.01, 1e4] at 4 bins per
  octave (``ClipSearch.per_octave``), estimated as ``quantile_from_histogram`` does;
* ``coarse-at-target``: one bin per octave, then a fine grid of 8 per octave one octave
  either side of the coarse estimate OF THE TARGET quantile, half the budget each;
* ``median-located``: what ``privacy/quantile.py`` does (the coarse stage locates the median
  with 0.2 of the budget, the fine grid spans [median / 2, 2^1.5 median] at 4 per octave);
* ``geometric-T``: adaptive clipping's update (Andrew et al., NeurIPS 2021): T rounds, each
  client releasing its noisy count of norms below C, the server moving
  C <- C exp(-eta (b - gamma)) with b the noisy fraction below, from C = 1, eta = 2.

Prints, per epsilon and target quantile, each estimator's median, 90th percentile and
largest |log(estimate / true quantile)| over ``--draws`` draws (seeded noise: a benchmark).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.quantile import (
    ClipSearch,
    geometric_edges,
    noisy_norm_histogram,
    private_quantile,
    quantile_from_histogram,
)


def one_stage(norms, q, z, g):
    edges = geometric_edges(1e-2, 1e4, 4)
    total = sum(noisy_norm_histogram(n, edges, z, generator=g) for n in norms)
    return quantile_from_histogram(total, edges, q)


def coarse_at_target(norms, q, z, g):
    edges = geometric_edges(1e-2, 1e4, 1)
    total = sum(noisy_norm_histogram(n, edges, z * math.sqrt(2), generator=g) for n in norms)
    centre = quantile_from_histogram(total, edges, q)
    edges = geometric_edges(max(centre / 2, 1e-2), min(centre * 2, 1e4), 8)
    total = sum(noisy_norm_histogram(n, edges, z * math.sqrt(2), generator=g) for n in norms)
    return quantile_from_histogram(total, edges, q)


def median_located(norms, q, z, g):
    return private_quantile(norms, ClipSearch(quantile=q), z, generator=g)


def geometric(steps: int, eta: float = 2.0):
    def estimate(norms, q, z, g):
        n_total, clip = sum(len(n) for n in norms), 1.0
        for _ in range(steps):
            below = sum(float((n <= clip).sum()) + z * math.sqrt(steps)
                        * float(torch.randn(1, generator=g, dtype=torch.float64))
                        for n in norms)
            clip *= math.exp(-eta * (below / n_total - q))
        return clip
    return estimate


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--draws", type=int, default=30)
    ap.add_argument("--eps", default="0.8,8")
    ap.add_argument("--sd", type=float, default=0.3)
    args = harness.parse(ap)
    results = []
    estimators = {"one-stage": one_stage, "coarse-at-target": coarse_at_target,
                  "median-located": median_located, "geometric-10": geometric(10),
                  "geometric-30": geometric(30)}
    for eps in (float(e) for e in args.eps.split(",")):
        (z,) = plan_noise(eps, 1e-5, [ReleasePlan("clip", 1.0, 1)])
        for q in (0.9, 0.95, 0.99):
            errors: dict[str, list[float]] = {k: [] for k in estimators}
            for draw in range(args.draws):
                g = torch.Generator().manual_seed(draw)
                scale = math.exp(float(torch.empty(1).uniform_(math.log(0.5), math.log(200),
                                                               generator=g)))
                norms = [scale * torch.exp(args.sd * torch.randn(200, generator=g,
                                                                 dtype=torch.float64))
                         for _ in range(10)]
                true = float(torch.cat(norms).quantile(q))
                for name, f in estimators.items():
                    errors[name].append(abs(math.log(f(norms, q, z, g) / true)))
            print(f"epsilon {eps:g} (z {z:.3f}), quantile {q:g}: " + "; ".join(
                f"{k} {np.median(v):.3f} / {np.quantile(v, 0.9):.3f} / {max(v):.3f}"
                for k, v in errors.items()), flush=True)
            results.append({"epsilon": eps, "z": z, "quantile": q, "abs_log_error": {
                k: {"median": float(np.median(v)), "p90": float(np.quantile(v, 0.9)),
                    "max": max(v)} for k, v in errors.items()}})
    harness.finish(args, {"rows": results})


if __name__ == "__main__":
    main()
