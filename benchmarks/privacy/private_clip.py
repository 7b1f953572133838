"""The feature clip chosen privately against the true quantiles and the hand-picked default.

    python benchmarks/privacy/private_clip.py [--rounds 5] [--seed 0] [--eps 8] [--share 0.1]
                                      [--repeats 10] [--quantiles 0.9,0.95,0.99]
                                      [--model mlp]

Trains FedAvg on digits (10 clients, Dirichlet 0.1, ``--model``; ``--rounds`` rounds, one
thread), then on the trained model's features, repeated ``--repeats`` times (fresh OS
noise each time):

* the clip ``privacy/quantile.py`` chooses at each target quantile, its release spending
  ``--share`` of ``--eps``, against the true quantile of all clients' feature norms;
* CCVR's accuracy with a DP release of the statistics (local noise on every client's upload,
  as privfedcal without secure aggregation): at the private clip, its noise multiplier from
  the plan that composes the clip's release and CCVR's to ``--eps``; at the default clip
  (``protection.DP_DEFAULT_CLIP``) and at the true quantiles (a central look, for
  reference), both with the whole ``--eps`` for CCVR's release.

Prints the norms' quantiles, each clip's mean and range, each accuracy's mean and std, and
the noise multipliers (``--repeats 0``: the norms only).
"""

from __future__ import annotations

import copy
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

import privfedcal
from privfedcal.calibration.ccvr import CCVR
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.dp import default_delta, gaussian_mechanism
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.planner import DP_DEFAULT_CLIP
from privfedcal.privacy.quantile import ClipSearch, feature_norms, private_feature_clip


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def ccvr_accuracy(exp, clients, clip: float, sigma: float) -> float:
    """One DP CCVR release at ``clip`` with multiplier ``sigma`` on every client's upload,
    the head re-trained on the noisy sum (``privfedcal.calibrate_head``)."""
    total = None
    for x, y in clients:
        stats = privfedcal.ccvr_statistics(exp.model, x, y, exp.data.num_classes, clip=clip)
        sens = CCVR.releases[0].sensitivities(stats.keys(), clip=clip, grad_clip=clip)
        noisy = gaussian_mechanism(stats, sens, sigma, noise_generator())
        total = noisy if total is None else {k: total[k] + noisy[k] for k in total}
    model = privfedcal.calibrate_head(copy.deepcopy(exp.model), total)
    model.eval()
    return accuracy(model, exp.data.x_test, exp.data.y_test)


def main() -> None:
    ap = harness.parser(__doc__, repeats=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eps", type=float, default=8.0)
    ap.add_argument("--share", type=float, default=0.1)
    ap.add_argument("--quantiles", default="0.9,0.95,0.99")
    ap.add_argument("--model", default="mlp")
    args = harness.parse(ap)
    torch.set_num_threads(1)
    quantiles = [float(q) for q in args.quantiles.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        run = privfedcal.train(method="fedavg", clients=10, rounds=args.rounds, threads=1,
                               device="cpu", seed=args.seed, model=args.model,
                               out=f"{tmp}/run")
        exp = run.experiment()
    exp.model.eval()
    data = exp.data
    clients = [(data.x_train[p], data.y_train[p]) for p in exp.parts]
    delta = default_delta(exp.num_examples)
    norms = torch.cat([feature_norms(exp.model.features, x) for x, _ in clients])
    true = {q: float(norms.quantile(q)) for q in quantiles}
    print(f"digits {args.model} after {args.rounds} rounds of FedAvg (seed {args.seed}): "
          f"{exp.num_examples} samples, delta {delta:.3g}")
    print("feature norms: " + ", ".join(f"q{q:g} {v:.3f}" for q, v in true.items())
          + f", max {float(norms.max()):.3f}; default clip {DP_DEFAULT_CLIP:g}")
    print(f"uncalibrated accuracy {accuracy(exp.model, data.x_test, data.y_test):.4f}")
    results = {"norm_quantiles": true, "max_norm": float(norms.max())}
    if args.repeats < 1:  # --repeats 0: the norms only
        harness.finish(args, results)
        return
    (z_all,) = plan_noise(args.eps, delta, [ReleasePlan("ccvr-stats", 1.0, 1)])
    rows = []
    base = [ccvr_accuracy(exp, clients, DP_DEFAULT_CLIP, z_all) for _ in range(args.repeats)]
    rows.append((f"default clip {DP_DEFAULT_CLIP:g}", DP_DEFAULT_CLIP, DP_DEFAULT_CLIP, z_all,
                 base))
    for q in quantiles:
        central = [ccvr_accuracy(exp, clients, true[q], z_all) for _ in range(args.repeats)]
        rows.append((f"true q{q:g} (central look)", true[q], true[q], z_all, central))
        clips, accs, sigma = [], [], math.nan
        for _ in range(args.repeats):
            choice = private_feature_clip(exp.model.features, [x for x, _ in clients],
                                          epsilon=args.eps, delta=delta,
                                          search=ClipSearch(quantile=q, share=args.share))
            clips.append(choice.clip)
            sigma = choice.sigmas[0]
            accs.append(ccvr_accuracy(exp, clients, choice.clip, sigma))
        rows.append((f"private q{q:g} (share {args.share:g})", min(clips), max(clips), sigma,
                     accs, float(np.mean(clips))))
    print(f"CCVR at epsilon {args.eps:g}, {args.repeats} noise draws each:")
    for row in rows:
        label, lo, hi, sigma, accs = row[:5]
        clip = f"{row[5]:.3f} [{lo:.3f}, {hi:.3f}]" if len(row) > 5 else f"{lo:.3f}"
        print(f"  {label:32s} clip {clip:26s} z {sigma:.3f}  accuracy "
              f"{np.mean(accs):.4f} +- {np.std(accs):.4f}")
    results["ccvr"] = [{"clip": row[0], "clip_min": row[1], "clip_max": row[2], "z": row[3],
                        "accuracy": row[4]} for row in rows]
    harness.finish(args, results)


if __name__ == "__main__":
    main()
