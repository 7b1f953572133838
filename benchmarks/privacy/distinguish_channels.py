"""Distinguishing experiments on the privacy channels of docs/threat-model.md.

Each game runs the real client code path on a dataset D and a neighbour D' (one example added
or removed) many times with fresh secret noise, scores what the server sees, picks a
threshold on one half of the trials and counts errors on the other half, and turns the
counts into a lower bound on epsilon at 95% confidence (``privacy/empirical.py``).

Games (digits, the MLP, CPU):

* ``dpsgd-loss``: a DP-SGD client of 80 examples, D' adds one mislabelled example; the
  server's score is the client's reported training loss when one is sent, else the norm of
  its update (all that is left).
* ``dpsgd-steps``: DP-SGD clients of 80 and 81 examples; the score is the update's norm (the
  number of noisy steps scales its noise).
* ``creff-cap``: CReFF's class gradients of a CIFAR-sized client (1,000 examples of one
  class, varied features) under the authors' cap of 10 x 32; D' removes the example (of
  every tenth) whose removal moves the release most; Gaussian noise for the claimed epsilon
  at sensitivity G, the optimal (likelihood-ratio) score.

* ``partition``: a run under ``--secagg --hide-counts`` (CCVR, 2 clients, IID digits) with
  a fresh public seed per trial; D: the first training example is in client 0's data, D':
  it is not. The adversary knows the code, the public config and the seed, and redraws the
  partition from the seed (the experiment's own ``build_experiment`` draws the real one);
  its score is whether its redraw puts the example in client 0.

The mechanisms come from whichever ``privfedcal`` is importable, so the same script measures
an older checkout: ``--before DIR`` runs the collection with ``PYTHONPATH=DIR`` in a
subprocess, then both are scored here::

    python benchmarks/privacy/distinguish_channels.py --before /path/to/checkout-at-d41de29
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

CLAIMED_EPS = 1.0
DELTA = 1e-5


def _dpsgd_client(n: int, outlier: bool, trials: int, seed: int) -> dict:
    """Scores of ``trials`` DP-SGD local trainings of one client (real train_client path)."""
    import dataclasses

    from privfedcal.experiment import build_experiment, calibrator_class
    from privfedcal.federation.local import clone_state, train_client
    from privfedcal.privacy.executor import training_spec
    from privfedcal.privacy.planner import plan_for_run
    from privfedcal.settings.run_config import RunConfig

    cfg = RunConfig.of(dataset="digits", clients=18, method="fedavg", dp_eps=CLAIMED_EPS,
                    dp_train=True, rounds=1, local_epochs=1, batch_size=32, device="cpu",
                    threads=1, transcript=False, seed=seed)
    exp = build_experiment(cfg)
    plan = plan_for_run(exp.privacy, calibrator_class(cfg), exp.num_examples)
    exp.spec = training_spec(exp.spec, plan)  # DP-SGD's schedule, as a run's
    x, y = exp.data.x_train, exp.data.y_train.clone()
    model = exp.model
    # a global model that already fits the data, so that a mislabelled example stands out
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(30):
        for i in range(0, len(x), 64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
            opt.step()
    start = clone_state(model)
    idx = torch.arange(n + (1 if outlier else 0))
    if outlier:
        y[n] = (y[n] + 5) % 10  # the canary: one mislabelled example
    spec = dataclasses.replace(exp.spec, data=dataclasses.replace(exp.spec.data, augment=False))
    losses, norms = [], []
    flat0 = torch.cat([v.flatten().float() for v in start.values()])
    for t in range(trials):
        r = train_client(model, exp.algo, start, None, x, y, idx, spec, 1, t)
        flat = torch.cat([v.flatten().float() for v in r.state.values()])
        norms.append(float((flat - flat0).norm()))
        losses.append(None if r.loss is None else float(r.loss))
    return {"loss": losses, "norm": norms}


def collect_dpsgd(trials: int) -> dict:
    return {"loss-D": _dpsgd_client(80, False, trials, 0),
            "loss-D'": _dpsgd_client(80, True, trials, 0),
            "steps-D": _dpsgd_client(80, False, trials, 0),
            "steps-D'": _dpsgd_client(81, False, trials, 0)}


class _Identity(torch.nn.Module):
    """A feature extractor that returns its input: the client's features are the data."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.feature_dim, self.num_classes = dim, classes
        self.classifier = torch.nn.Linear(dim, classes)

    def features(self, x):
        return x

    def forward(self, x):
        return self.classifier(x)


def collect_creff() -> dict:
    """The pre-noise CReFF release of a CIFAR-sized capped class for D and its worst
    neighbour: 1,000 examples of one class with varied 64-d features, the authors' cap of
    10 x 32, clip G = 1, sample weighting (the form DP uses)."""
    from privfedcal.calibration.creff import GradTask
    from privfedcal.privacy.dp import L2Clip

    g = torch.Generator().manual_seed(1)
    n, dim, cap = 1000, 64, 320
    x, y = torch.randn(n, dim, generator=g), torch.zeros(n, dtype=torch.long)
    model = _Identity(dim, 10).eval()
    w, b = torch.randn(10, dim, generator=g), torch.zeros(10)
    clip = 1.0
    bound = L2Clip({"feature": 100.0, "class-gradient": clip})
    task = GradTask(w, b, 10, "sample", 256, cap, 7)
    base = task.compute(model, x, y, bound)["grad"].double().flatten()
    worst, moved = None, -1.0
    for i in range(0, n, 10):  # every tenth example's removal
        rest = torch.arange(n) != i
        other = task.compute(model, x[rest], y[rest], bound)["grad"].double().flatten()
        d = float((other - base).norm())
        if d > moved:
            worst, moved = other, d
    return {"D": base.tolist(), "D'": worst.tolist(), "moved_over_G": moved / clip,
            "class_size": n, "cap": cap}


def collect_partition(trials: int) -> dict:
    """Per trial: whether the run's partition puts example 0 in client 0 (the truth) and
    whether the adversary's redraw from the public seed does (its score)."""
    from privfedcal.data.partition import PartitionSpec, partition_indices
    from privfedcal.experiment import build_experiment
    from privfedcal.settings.run_config import RunConfig

    truth, guess = [], []
    for t in range(2 * trials):
        cfg = RunConfig.of(dataset="digits", clients=2, partition="iid", method="ccvr",
                        secagg=True, hide_counts=True, rounds=1, device="cpu", threads=1,
                        transcript=False, seed=1000 + t)
        exp = build_experiment(cfg)
        truth.append(bool((exp.parts[0] == 0).any()))
        labels = exp.data.y_train.cpu().numpy()
        spec = PartitionSpec(scheme=cfg.data.partition, num_clients=cfg.data.clients, alpha=cfg.data.alpha,
                             imbalance_factor=cfg.data.imbalance_factor,
                             shards_per_client=cfg.data.shards_per_client, min_size=cfg.data.min_size)
        redraw = partition_indices(labels, spec, cfg.training.seed)
        guess.append(float(0 in set(redraw[0].tolist())))
    return {"truth": truth, "guess": guess}


COLLECTORS = {"dpsgd": collect_dpsgd, "creff": lambda trials: collect_creff(),
              "partition": collect_partition}


def collect(trials: int, games: list[str]) -> dict:
    torch.set_num_threads(1)
    return {g: COLLECTORS[g](trials) for g in games}


# ---- scoring (always the current checkout) ---------------------------------------------------

def bound_from_scores(neg: list[float], pos: list[float]) -> dict:
    """Threshold on the first half (larger score = D'), errors on the second half."""
    from privfedcal.privacy.empirical import epsilon_lower_bound

    h0, h1 = len(neg) // 2, len(pos) // 2
    cal0, cal1 = sorted(neg[:h0]), pos[:h1]
    best, thr = -1.0, 0.0
    for t in cal0 + sorted(cal1):  # the threshold with the best calibration accuracy
        acc = sum(s <= t for s in cal0) + sum(s > t for s in cal1)
        if acc > best:
            best, thr = acc, t
    test0, test1 = neg[h0:], pos[h1:]
    fp = sum(s > thr for s in test0)
    fn = sum(s <= thr for s in test1)
    eps = epsilon_lower_bound(fp, len(test0), fn, len(test1), DELTA, 0.95)
    return {"fp": fp, "fn": fn, "trials": len(test0) + len(test1), "eps_lower": round(eps, 3)}


def score_creff(c: dict, trials: int) -> dict:
    """Gaussian noise for CLAIMED_EPS at sensitivity G (one release), the optimal score."""
    from opacus.accountants.utils import get_noise_multiplier

    z = get_noise_multiplier(target_epsilon=CLAIMED_EPS, target_delta=DELTA, sample_rate=1.0,
                             steps=1, accountant="rdp")
    d0, d1 = torch.tensor(c["D"], dtype=torch.float64), torch.tensor(c["D'"], dtype=torch.float64)
    diff = d1 - d0
    g = torch.Generator().manual_seed(0)
    scores = []
    for base in (d0, d1):
        noisy = base + z * 1.0 * torch.randn(trials, len(base), generator=g, dtype=torch.float64)
        scores.append(((noisy - (d0 + d1) / 2) @ diff).tolist())
    out = bound_from_scores(*scores)
    out.update(moved_over_G=round(c["moved_over_G"], 3), noise_multiplier=round(z, 3))
    return out


def score(raw: dict, trials: int) -> dict:
    out = {}
    if "dpsgd" in raw:
        d = raw["dpsgd"]
        key = "loss" if d["loss-D"]["loss"][0] is not None else "norm"  # loss when sent
        out["dpsgd-loss"] = {"score": key,
                             **bound_from_scores(d["loss-D"][key], d["loss-D'"][key])}
        out["dpsgd-steps"] = {"score": "norm", **bound_from_scores(d["steps-D"]["norm"],
                                                                   d["steps-D'"]["norm"])}
    if "creff" in raw:
        out["creff-cap"] = score_creff(raw["creff"], trials)
    if "partition" in raw:
        out["partition"] = score_partition(raw["partition"])
    return out


def score_partition(p: dict) -> dict:
    """D' (example not in client 0) scores 0 by the adversary's redraw when it is right."""
    neg = [1 - s for s, held in zip(p["guess"], p["truth"], strict=True) if held]
    pos = [1 - s for s, held in zip(p["guess"], p["truth"], strict=True) if not held]
    return {"score": "seed redraw", **bound_from_scores(neg, pos)}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--trials", type=int, default=400, help="trials per side (half calibrate)")
    p.add_argument("--before", help="a checkout to measure too, e.g. one at d41de29")
    p.add_argument("--games", default=",".join(COLLECTORS),
                   help=f"comma-separated subset of {', '.join(COLLECTORS)}")
    p.add_argument("--collect", help=argparse.SUPPRESS)  # internal: raw scores to this file
    a = harness.parse(p)
    games = [g.strip() for g in a.games.split(",") if g.strip()]
    unknown = sorted(set(games) - set(COLLECTORS))
    if unknown or not games:
        p.error(f"--games takes {', '.join(COLLECTORS)}; got {a.games!r}")
    if a.collect:
        Path(a.collect).write_text(json.dumps(collect(a.trials, games)))
        return
    runs = [("before", a.before)] if a.before else []
    runs.append(("after", str(Path(__file__).resolve().parents[2])))
    results = {}
    for name, root in runs:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "raw.json"
            env = {**os.environ, "PYTHONPATH": root}
            subprocess.run([sys.executable, __file__, "--collect", str(out), "--trials",
                            str(a.trials), "--games", ",".join(games)], env=env, check=True,
                           cwd=tmp)
            raw = json.loads(out.read_text())
        rows = score(raw, a.trials)
        secs = time.perf_counter() - t0
        for game, r in rows.items():
            claim = ("claim: hidden (no epsilon; 0 is the ideal)" if game == "partition"
                     else f"claimed eps {CLAIMED_EPS:g} (delta {DELTA:g})")
            print(f"{name} {game}: {claim}, "
                  f"eps_lower {r['eps_lower']} at 95% "
                  f"({r['fp']} false pos, {r['fn']} false neg of {r['trials']} test trials"
                  + (f", score {r['score']}" if "score" in r else "")
                  + (f", release moved {r['moved_over_G']} G" if "moved_over_G" in r else "")
                  + ")")
        print(f"{name}: {secs:.0f} s")
        results[name] = {"root": root, "seconds": secs, "games": rows}
        if not math.isfinite(secs):
            raise SystemExit(1)
    harness.finish(a, results)


if __name__ == "__main__":
    main()
