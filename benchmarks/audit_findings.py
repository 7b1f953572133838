"""Findings of docs/privacy-audit.md: how much of a client's images CCVR's uploads give away.

Tests the CCVR paper's appendix C claim that class statistics are "basically
privacy-preserving" (it inverted the mean of 3 features only). Method:

1. Train (or load with --run) a CCVR run on digits; the server's extractor is the model
   state recorded in the transcript for the statistics release.
2. For every n in --ns and every class of --classes, pick n training images of that class
   from the client holding most of it (seeded): exactly the sets a client with n samples
   of the class would summarise. Their features under the released extractor give the
   upload (count, sum, sum of outer products), computed directly (``ClassStats``).
3. Control: n random TEST images of the class (public data, nothing from the client),
   scored like a reconstruction: the chance level of every metric.
   Attacks: raw features (each image's own feature: the baseline), the class mean (one
   image, CCVR appendix C), mean + covariance (a batch of n images, matched to the truth by
   the Hungarian assignment). Scored with ``attacks.report.score`` (PSNR, SSIM, feature
   cosine against the true features, nearest training image, and the PSNR of the test-set
   class mean image: a guess that uses no client data).
4. The same statistics under DP: features clipped to R = 10 (the default), the Gaussian
   mechanism with the noise multiplier the accountant plans for one release at epsilon
   (delta = min(1e-5, 1/(10 N))), moments from the noisy sums (``noisy_stats_to_moments``).
5. Secure aggregation: the attacker sees the federation's class statistics only; the same
   attacks on the aggregate of every client.

Run: ``python benchmarks/audit_findings.py --out runs/findings`` (about 12 CPU-minutes with
the defaults; ``--rounds 2 --eps none`` for a barely trained extractor). Prints a markdown
table and writes findings.json / findings.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from privfedcal.attacks.feature_inversion import FeatureTarget, invert_features
from privfedcal.attacks.report import score
from privfedcal.attacks.runner import STATS_LABEL, UploadedFeatures, load_run
from privfedcal.calibration.stats import ClassStats
from privfedcal.federation.local import make_generator
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.dp import gaussian_mechanism, noisy_stats_to_moments, payload_sensitivities
from privfedcal.privacy.protection import DP_DEFAULT_CLIP

RUN = ["--dataset", "digits", "--clients", "5", "--alpha", "0.3", "--local-epochs", "2",
       "--device", "cpu", "--threads", "1"]


def train_run(out: Path, rounds: int) -> Path:
    from privfedcal.cli.main import main

    run = out / "run"
    if not (run / "summary.json").exists():
        main(["train", "--method", "ccvr", *RUN, "--rounds", str(rounds), "--out", str(run)])
    return run


def guess(view, cls: int, idx: torch.Tensor, size: int, *, seed: int) -> dict:
    """The control: ``size`` random TEST images of the class (public data, nothing from the
    client), scored exactly like a reconstruction. Its numbers are chance level."""
    d = view.exp.data
    pool = torch.nonzero(d.y_test == cls).flatten()
    g = make_generator(seed, cls, size, 74)
    pick = pool[torch.randperm(pool.numel(), generator=g)[:min(size, pool.numel(), idx.numel())]]
    images = d.denormalize(d.x_test[pick]).clamp(0, 1)
    rec, _ = score(view, images, idx, paired=False)
    return {k: rec[k] for k in ("psnr", "ssim", "feature_cosine", "nearest_is_true",
                                "prior_psnr")}


def attack(view, model, target, idx, *, paired, seed, args) -> dict:
    d = view.exp.data
    res = invert_features(model, target, image_shape=d.x_train.shape[1:], mean=d.mean,
                          std=d.std, generator=make_generator(args.seed, seed, 0, 71),
                          steps=args.steps, restarts=args.restarts)
    rec, _ = score(view, res.images, idx, paired=paired)
    return {k: rec[k] for k in ("psnr", "ssim", "feature_cosine", "nearest_is_true",
                                "prior_psnr")}


def stats_of(model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        z = model.features(x)
    return ClassStats.from_features(z, torch.zeros(len(x), dtype=torch.long), 1).to_payload()


def moments(payload: dict[str, torch.Tensor], noisy: bool):
    if noisy:
        count, mean, cov = noisy_stats_to_moments(payload["count"], payload["sum"],
                                                  payload["outer"])
    else:
        st = ClassStats.from_payload(payload)
        count, mean, cov = st.count, st.mean(), st.covariance()
    return max(1, int(round(float(count[0])))), mean[0].float(), cov[0].float()


def run_findings(args) -> list[dict]:
    torch.set_num_threads(1)
    run = args.run or train_run(args.out, args.rounds)
    view = load_run(run)
    rel = view.release(STATS_LABEL, None)
    view.load_state(rel.state)
    model, d = view.model, view.exp.data
    n_total = int(sum(p.numel() for p in view.exp.parts))
    delta = min(1e-5, 1 / (10 * n_total))
    clipped = UploadedFeatures(model, None, DP_DEFAULT_CLIP)
    rows: list[dict] = []

    def add(setting, n, cls, kind, rec):
        rows.append({"setting": setting, "n": n, "class": cls, "attack": kind, **rec})
        print(f"{setting:>10} n={n:<4} class {cls} {kind:<11} PSNR {rec['psnr']:6.2f} "
              f"(prior {rec['prior_psnr']:5.2f}) fcos {rec['feature_cosine']:.3f} "
              f"NN {rec['nearest_is_true']:.2f}", flush=True)

    for cls in args.classes:
        owner = int(view.exp.counts[:, cls].argmax())
        pool = view.truth(owner, cls)
        for n in args.ns:
            if pool.numel() < n:
                print(f"class {cls}: client {owner} holds {pool.numel()} < {n}; skipped")
                continue
            g = make_generator(args.seed, cls, n, 72)
            idx = pool[torch.randperm(pool.numel(), generator=g)[:n]]
            x = d.x_train[idx]
            seed = 100 * cls + n
            with torch.no_grad():
                z = model.features(x)
            add("plain", n, cls, "raw", attack(view, model, FeatureTarget.raw(z), idx,
                                               paired=True, seed=seed, args=args))
            add("plain", n, cls, "guess", guess(view, cls, idx, n, seed=seed))
            k, mu, cov = moments(stats_of(model, x), noisy=False)
            add("plain", n, cls, "mean", attack(view, model, FeatureTarget.class_mean(mu, k),
                                                idx, paired=False, seed=seed + 1, args=args))
            add("plain", n, cls, "mean+cov", attack(
                view, model, FeatureTarget.class_stats(k, mu, cov), idx, paired=False,
                seed=seed + 2, args=args))
            payload = stats_of(clipped, x)
            sens = payload_sensitivities(payload, clip=DP_DEFAULT_CLIP, grad_clip=1.0)
            for eps in args.eps:
                (sigma,) = plan_noise(eps, delta, [ReleasePlan(STATS_LABEL, 1.0, 1)])
                noisy = gaussian_mechanism(payload, sens, sigma,
                                           make_generator(args.seed, seed, int(eps * 100), 73))
                k, mu, cov = moments(noisy, noisy=True)
                setting = f"dp eps={eps:g}"
                add(setting, n, cls, "mean", attack(
                    view, clipped, FeatureTarget.class_mean(mu, k), idx, paired=False,
                    seed=seed + 3, args=args))
                if k <= args.max_n:
                    add(setting, n, cls, "mean+cov", attack(
                        view, clipped, FeatureTarget.class_stats(k, mu, cov), idx,
                        paired=False, seed=seed + 4, args=args))
        # secure aggregation: the federation's statistics of the class, nothing per client
        everyone = view.truth(None, cls)
        k, mu, cov = moments(stats_of(model, d.x_train[everyone]), noisy=False)
        add("secagg", k, cls, "guess", guess(view, cls, everyone, k, seed=cls + 6))
        add("secagg", k, cls, "mean", attack(view, model, FeatureTarget.class_mean(mu, k),
                                             everyone, paired=False, seed=cls + 7, args=args))
        add("secagg", k, cls, "mean+cov", attack(
            view, model, FeatureTarget.class_stats(k, mu, cov), everyone, paired=False,
            seed=cls + 8, args=args))
    return rows


def table(rows: list[dict]) -> str:
    """Mean over classes per (setting, n, attack)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        n = "N_c" if r["setting"] == "secagg" else r["n"]
        groups.setdefault((r["setting"], n, r["attack"]), []).append(r)
    lines = ["| setting | n | attack | PSNR dB | prior dB | SSIM | feature cos | NN = true |",
             "|---|---|---|---|---|---|---|---|"]
    for (setting, n, kind), rs in groups.items():
        m = {k: sum(r[k] for r in rs) / len(rs) for k in
             ("psnr", "prior_psnr", "ssim", "feature_cosine", "nearest_is_true")}
        lines.append(f"| {setting} | {n} | {kind} | {m['psnr']:.2f} | {m['prior_psnr']:.2f} | "
                     f"{m['ssim']:.3f} | {m['feature_cosine']:.3f} | "
                     f"{m['nearest_is_true']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=None, help="a CCVR run folder (default: train)")
    p.add_argument("--out", type=Path, default=Path("runs/audit-findings"))
    p.add_argument("--ns", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2, 3, 10])
    p.add_argument("--classes", type=lambda s: [int(t) for t in s.split(",")],
                   default=[0, 3, 8])
    p.add_argument("--eps", type=lambda s: [float(t) for t in s.split(",") if t != "none"],
                   default=[1.0, 2.0, 4.0, 8.0], help="DP epsilons (none: skip DP)")
    p.add_argument("--rounds", type=int, default=10, help="rounds of the trained run")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--max-n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_findings(args)
    text = table(rows)
    print(text)
    (args.out / "findings.json").write_text(json.dumps(
        [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
          for k, v in r.items()} for r in rows], indent=1))
    (args.out / "findings.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
