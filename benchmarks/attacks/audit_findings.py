"""Findings of docs/results/privacy.md: how much of a client's images CCVR's and CReFF's
uploads give away to converged attacks, worst case first.

Tests the CCVR paper's appendix C claim that class statistics are "basically
privacy-preserving" (it inverted the mean of 3 features only). Method:

1. Train (or load with --run) a CCVR run on digits; the server's extractor is the model
   state recorded in the transcript for the statistics release.
2. For every n in --ns and every class of --classes, pick n training images of that class
   from the client holding most of it (seeded): exactly the sets a client with n samples
   of the class would summarise. Their features under the released extractor give the
   upload (count, sum, sum of outer products), computed directly (``ClassStats``), and the
   CReFF class gradient of those n samples under the released head.
3. Control: n random TEST images of the class (public data, nothing from the client),
   scored like a reconstruction: the chance level of every metric.
   Attacks (``--parts plain``): raw features (each image's own feature: the baseline), the
   class mean (one image, CCVR appendix C), mean + covariance (a batch of n images matched
   to mean AND covariance). ``--parts grad``: the class gradient, features recovered
   analytically (rank-n recovery for n <= --rank-max, the weighted-mean least-squares
   estimate above), then inverted. Every inversion runs to convergence (the library's
   default stopping rule, cap --steps). Scored with ``attacks.report.score``: PSNR of the
   reconstructions (mean) and of the best one (the worst-off individual), nearest training
   image, and the data-free prior under the same rule.
   ``--parts update``: the smallest client's FedAvg update (``--update-n`` keeps a seeded
   subset of its images: a smaller client with the same recipe), inverted.
4. ``--parts dp``: the same statistics under DP: features clipped to R = 10 (the default),
   the Gaussian mechanism with the noise multiplier the accountant plans for one release
   at epsilon (delta = min(1e-5, 1/(10 N))), moments from the noisy sums.
5. ``--parts secagg``: the attacker sees the federation's class statistics only; the same
   attacks on the aggregate, scored against the SAME n images as the per-client rows.
6. ``--parts trace``: PSNR / nearest = true of the best restart at every convergence check
   of raw n = 1 and mean + covariance n = 2, 3, 10 (the plot of docs/results/privacy.md).
7. ``--parts rounds``: a CReFF run (``--creff-run``, else trained with the same recipe);
   the n images' class gradients under the model state and head the transcript records
   for each of its last ``--rounds-combined`` releases, attacked from the last release
   alone (as ``grad``) and from all of them together (``invert_class_gradients``).

``--tv``, ``--lr``, ``--jitter``, ``--init-scale`` override the library's settings of the
feature inversions (``benchmarks/probes/inversion_strength.py`` compares settings on raw n = 1).

Run: ``python benchmarks/attacks/audit_findings.py --out runs/findings --parts plain`` (one part per
process parallelises well). Writes findings-<parts>.json / .md and, for ``trace``,
steps.png, into ``--out``; prints the machine line, and ``--json PATH`` writes the same rows
as the benchmarks' common record (``harness.py``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

from privfedcal.attacks.reconstruction.feature_inversion import FeatureTarget, invert_features
from privfedcal.attacks.reconstruction.gradient_inversion import (
    recover_from_class_gradient,
    recover_rank_n,
)
from privfedcal.attacks.reconstruction.runner import UploadedFeatures, load_run
from privfedcal.attacks.reconstruction.scoring import score
from privfedcal.calibration.ccvr import CCVR
from privfedcal.calibration.ccvr import CCVR_RELEASE as STATS_LABEL
from privfedcal.calibration.stats import ClassStats
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.dp import gaussian_mechanism, noisy_stats_to_moments
from privfedcal.privacy.planner import DP_DEFAULT_CLIP
from privfedcal.seeding import make_generator

RUN = ["--dataset", "digits", "--clients", "5", "--alpha", "0.3", "--local-epochs", "2",
       "--device", "cpu", "--threads", "1"]
KEYS = ("psnr", "psnr_best", "ssim", "feature_cosine", "nearest_is_true", "nearest_of_best",
        "prior_psnr", "prior_psnr_best")
PARTS = ("plain", "grad", "dp", "secagg", "trace", "update", "rounds")


def train_run(out: Path, rounds: int, method: str = "ccvr") -> Path:
    from privfedcal.cli.main import main

    run = out / ("run" if method == "ccvr" else f"run-{method}")
    if not (run / "summary.json").exists():
        main(["train", "--method", method, *RUN, "--rounds", str(rounds), "--out", str(run)])
    return run


def rounds_findings(args, sets: dict, add) -> None:
    """CReFF class gradients of the same n images in the last ``--rounds-combined`` releases
    of a CReFF run (each under the model state and head the transcript recorded for it),
    attacked one release at a time (the last) and all together."""
    from privfedcal.attacks.reconstruction.gradients_attack import creff_head
    from privfedcal.attacks.reconstruction.rounds import invert_class_gradients
    from privfedcal.calibration.creff import CREFF_RELEASE as GRAD_LABEL

    view = load_run(args.creff_run or train_run(args.out, args.rounds, "creff"))
    rels = [r for r in view.releases(GRAD_LABEL) if r.state is not None
            and "head.weight" in r.task][-args.rounds_combined:]
    if not rels:
        raise SystemExit("the CReFF run's transcript records no heads (re-train it)")
    d = view.truth_exp.data
    for (cls, n), idx in sets.items():
        x, seed = d.x_train[idx], 100 * cls + n
        heads, grads = [creff_head(view, r) for r in rels], []
        for r, (w, b) in zip(rels, heads, strict=True):
            view.load_state(r.state)
            with torch.no_grad():
                z = view.model.features(x).double()
            grads.append(_class_gradient_of(z, w, b, cls))
        view.load_state(rels[-1].state)
        w, b = heads[-1]
        if n <= args.rank_max:
            rn = recover_rank_n(grads[-1], w, b, cls, n,
                                generator=make_generator(args.seed, seed, 0, 75))
            target, kind = FeatureTarget.raw(rn.features.float()), "1 round rank-n"
        else:
            z_hat, _ = recover_from_class_gradient(grads[-1][:, :-1], grads[-1][:, -1])
            target, kind = FeatureTarget.raw(z_hat.float()[None]), "1 round mean"
        add("creff", n, cls, kind, attack(view, view.model, target, idx, paired=False,
                                          seed=seed + 6, args=args))
        from privfedcal.attacks.reconstruction.feature_inversion import InversionConfig

        res = invert_class_gradients(
            view.model, [r.state for r in rels], heads, grads, cls, n,
            image_shape=d.x_train.shape[1:], mean=d.mean, std=d.std,
            generator=make_generator(args.seed, seed, 0, 77),
            config=InversionConfig(steps=args.steps, restarts=args.restarts, tv_weight=1e-2,
                                   l2_weight=0.0, jitter=0, bn_weight=0.0))
        view.load_state(rels[-1].state)
        add("creff", n, cls, f"{len(rels)} rounds", {
            **scored(view, res.images, idx, paired=False), **res.convergence.as_record(),
            "gradient_cosine": res.gradient_cosine, "rounds": [r.round for r in rels]})


def _class_gradient_of(z: torch.Tensor, w: torch.Tensor, b, cls: int) -> torch.Tensor:
    from privfedcal.calibration.creff import per_sample_head_grads

    y = torch.full((len(z),), cls, dtype=torch.long)
    return per_sample_head_grads(z, y, w.double(), None if b is None else b.double()).mean(0)


def scored(view, images, idx, *, paired) -> dict:
    rec, _ = score(view, images, idx, paired=paired)
    return {k: rec[k] for k in KEYS}


def guess(view, cls: int, idx: torch.Tensor, size: int, *, seed: int) -> dict:
    """The control: ``size`` random TEST images of the class (public data, nothing from the
    client; as many as the attack reconstructs), scored exactly like a reconstruction. Its
    numbers are chance level."""
    d = view.truth_exp.data
    pool = torch.nonzero(d.y_test == cls).flatten()
    g = make_generator(seed, cls, size, 74)
    pick = pool[torch.randperm(pool.numel(), generator=g)[:min(size, pool.numel())]]
    images = d.denormalize(d.x_test[pick]).clamp(0, 1)
    return scored(view, images, idx, paired=False)


def invert(view, model, target, *, seed, args, trace=None):
    d = view.truth_exp.data
    return invert_features(model, target, image_shape=d.x_train.shape[1:], mean=d.mean,
                           std=d.std, generator=make_generator(args.seed, seed, 0, 71),
                           steps=args.steps, restarts=args.restarts, tv_weight=args.tv,
                           lr=args.lr, jitter=args.jitter, init_scale=args.init_scale,
                           trace=trace)


def attack(view, model, target, idx, *, paired, seed, args) -> dict:
    res = invert(view, model, target, seed=seed, args=args)
    return {**scored(view, res.images, idx, paired=paired), **res.convergence.as_record()}


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


def stats_target(k: int, mu, cov) -> FeatureTarget:
    return FeatureTarget.class_mean(mu, k) if k == 1 else FeatureTarget.class_stats(k, mu, cov)


def class_gradient(model, x: torch.Tensor, cls: int) -> torch.Tensor:
    """One client's CReFF upload for class ``cls`` (client weighting: the mean over its n
    samples of the CE gradient w.r.t. [W | b]) under the released head."""
    from privfedcal.calibration.creff import per_sample_head_grads

    with torch.no_grad():
        z = model.features(x).double()
        w, b = model.classifier.weight.double(), model.classifier.bias.double()
        y = torch.full((len(x),), cls, dtype=torch.long)
        return per_sample_head_grads(z, y, w, b).mean(0)


def run_findings(args) -> tuple[list[dict], list[dict]]:
    torch.set_num_threads(1)
    run = args.run or train_run(args.out, args.rounds)
    view = load_run(run)
    rel = view.release(STATS_LABEL, None)
    view.load_state(rel.state)
    model, d = view.model, view.truth_exp.data
    n_total = int(sum(p.numel() for p in view.truth_exp.parts))
    delta = min(1e-5, 1 / (10 * n_total))
    clipped = UploadedFeatures(model, None, DP_DEFAULT_CLIP)
    rows: list[dict] = []
    traces: list[dict] = []

    def add(setting, n, cls, kind, rec):
        rows.append({"setting": setting, "n": n, "class": cls, "attack": kind, **rec})
        err = rec.get("feature_error")
        steps = (f" steps {rec['steps_run']:>5} {rec['stopped']} rel. error "
                 f"{'-' if err is None else format(err, '.2g')} feature cos "
                 f"{rec.get('feature_cosine', float('nan')):.3f}" if "steps_run" in rec else "")
        print(f"{setting:>10} n={n:<4} class {cls} {kind:<14} PSNR {rec['psnr']:6.2f} max "
              f"{rec['psnr_best']:6.2f} (prior {rec['prior_psnr']:5.2f} max "
              f"{rec['prior_psnr_best']:5.2f}) NN {rec['nearest_is_true']:.2f} NN@max "
              f"{rec['nearest_of_best']!s:5}{steps}", flush=True)

    sets = {}
    for cls in args.classes:
        owner = int(view.truth_exp.counts[:, cls].argmax())
        pool = view.truth(owner, cls)
        for n in args.ns:
            if pool.numel() < n:
                print(f"class {cls}: client {owner} holds {pool.numel()} < {n}; skipped")
                continue
            g = make_generator(args.seed, cls, n, 72)
            sets[cls, n] = pool[torch.randperm(pool.numel(), generator=g)[:n]]

    for (cls, n), idx in sets.items():
        x, seed = d.x_train[idx], 100 * cls + n
        if "plain" in args.parts:
            if n == 1:
                with torch.no_grad():
                    z = model.features(x)
                add("plain", n, cls, "raw", attack(view, model, FeatureTarget.raw(z), idx,
                                                   paired=True, seed=seed, args=args))
            add("plain", n, cls, "guess", guess(view, cls, idx, n, seed=seed))
            k, mu, cov = moments(stats_of(model, x), noisy=False)
            add("plain", n, cls, "mean", attack(view, model, FeatureTarget.class_mean(mu, k),
                                                idx, paired=False, seed=seed + 1, args=args))
            if n > 1:
                add("plain", n, cls, "mean+cov", attack(view, model, stats_target(k, mu, cov),
                                                        idx, paired=False, seed=seed + 2,
                                                        args=args))
        if "grad" in args.parts:
            grad = class_gradient(model, x, cls)
            if n <= args.rank_max:
                rn = recover_rank_n(grad, model.classifier.weight, model.classifier.bias, cls,
                                    n, generator=make_generator(args.seed, seed, 0, 75))
                z_hat, kind = rn.features.float(), "grad rank-n"
                extra = {"fit_residual": rn.residual, "rank": rn.rank}
            else:
                z_hat, info = recover_from_class_gradient(grad[:, :-1], grad[:, -1])
                z_hat, kind = z_hat.float()[None], "grad mean"
                extra = {"fit_residual": float(info.residual)}
            rec = attack(view, model, FeatureTarget.raw(z_hat), idx, paired=False,
                         seed=seed + 5, args=args)
            add("plain", n, cls, kind, {**rec, **extra})
        if "dp" in args.parts:
            payload = stats_of(clipped, x)
            sens = CCVR.releases[0].sensitivities(payload, clip=DP_DEFAULT_CLIP, grad_clip=1.0)
            for eps in args.eps:
                (sigma,) = plan_noise(eps, delta, [ReleasePlan(STATS_LABEL, 1.0, 1)])
                noisy = gaussian_mechanism(payload, sens, sigma,
                                           make_generator(args.seed, seed, int(eps * 100), 73))
                k, mu, cov = moments(noisy, noisy=True)
                setting = f"dp eps={eps:g}"
                add(setting, n, cls, "mean", attack(
                    view, clipped, FeatureTarget.class_mean(mu, k), idx, paired=False,
                    seed=seed + 3, args=args))
                if 1 < k <= args.max_n:
                    add(setting, n, cls, "mean+cov", attack(
                        view, clipped, FeatureTarget.class_stats(k, mu, cov), idx,
                        paired=False, seed=seed + 4, args=args))

    if "secagg" in args.parts:
        # the federation's statistics of the class, nothing per client: one inversion per
        # class, scored against the same n images as the per-client rows
        for cls in args.classes:
            everyone = view.truth(None, cls)
            k, mu, cov = moments(stats_of(model, d.x_train[everyone]), noisy=False)
            mean_res = invert(view, model, FeatureTarget.class_mean(mu, k), seed=cls + 7,
                              args=args)
            stats_res = (invert(view, model, FeatureTarget.class_stats(k, mu, cov),
                                seed=cls + 8, args=args) if k <= args.max_n else None)
            for (c2, n), idx in sets.items():
                if c2 != cls:
                    continue
                add("secagg", n, cls, "guess", guess(view, cls, idx, k, seed=cls + 6))
                add("secagg", n, cls, "mean", {**scored(view, mean_res.images, idx,
                                                        paired=False),
                                               **mean_res.convergence.as_record()})
                if stats_res is not None:
                    add("secagg", n, cls, "mean+cov",
                        {**scored(view, stats_res.images, idx, paired=False),
                         **stats_res.convergence.as_record(), "aggregate_n": k})

    if "update" in args.parts:
        # the FedAvg update of the smallest client, as the transcript records it (its full
        # state after local training with the run's recipe and batch order), inverted
        from privfedcal.attacks.reconstruction.feature_inversion import InversionConfig
        from privfedcal.attacks.reconstruction.model_updates import (
            LocalRecipe,
            invert_model_update,
            simulate_local_training,
        )

        cfg = view.cfg
        client = int(min(range(len(view.truth_exp.parts)), key=lambda c: view.truth_exp.parts[c].numel()))
        idx = view.truth_exp.parts[client]
        if args.update_n is not None and args.update_n < idx.numel():
            # a client holding only --update-n of those images (seeded pick): the same
            # recipe on fewer images, where a CPU can run the attack to convergence
            g = make_generator(args.seed, client, args.update_n, 78)
            idx = idx[torch.randperm(idx.numel(), generator=g)[:args.update_n]]
        recipe = LocalRecipe(cfg.training.local_epochs, cfg.training.batch_size, cfg.training.lr, cfg.training.momentum,
                             cfg.training.weight_decay)
        g = make_generator(cfg.training.seed, rel.round, client, 1)
        order = [torch.randperm(idx.numel(), generator=g) for _ in range(cfg.training.local_epochs)]
        start = dict(rel.state)
        after = {**start, **{k: v.detach() for k, v in simulate_local_training(
            model, start, d.x_train[idx], d.y_train[idx], recipe, order=order).items()}}
        res = invert_model_update(
            model, start, after, recipe, n=int(idx.numel()), image_shape=d.x_train.shape[1:],
            mean=d.mean, std=d.std, generator=make_generator(args.seed, client, 0, 76),
            config=InversionConfig(steps=args.steps, restarts=1, tv_weight=1e-2,
                                   l2_weight=0.0, jitter=0, bn_weight=0.0))
        view.load_state(rel.state)
        true_counts = torch.bincount(d.y_train[idx], minlength=d.num_classes)
        got_counts = torch.bincount(res.labels, minlength=d.num_classes)
        add("plain", int(idx.numel()), "all", f"update k{client}", {
            **scored(view, res.images, idx, paired=False), **res.convergence.as_record(),
            "label_count_error": int((true_counts - got_counts).abs().sum()),
            "update_cosine": res.gradient_cosine})

    if "rounds" in args.parts:
        rounds_findings(args, sets, add)

    if "trace" in args.parts:
        cls = args.classes[0]
        for n in (1, 2, 3, 10):
            if (cls, n) not in sets:
                continue
            idx = sets[cls, n]
            x = d.x_train[idx]
            if n == 1:
                with torch.no_grad():
                    target, kind = FeatureTarget.raw(model.features(x)), "raw"
            else:
                k, mu, cov = moments(stats_of(model, x), noisy=False)
                target, kind = FeatureTarget.class_stats(k, mu, cov), "mean+cov"
            seen: list[tuple[int, torch.Tensor]] = []
            res = invert(view, model, target, seed=100 * cls + n + 2, args=args,
                         trace=lambda step, pix, seen=seen: seen.append((step, pix.cpu())))
            for step, pix in seen:
                rec = scored(view, pix, idx, paired=n == 1)
                traces.append({"n": n, "class": cls, "attack": kind, "step": step, **rec})
            print(f"trace n={n} {kind}: {len(seen)} checks, {res.convergence}", flush=True)
    return rows, traces


def table(rows: list[dict]) -> str:
    """Per (setting, n, attack) over classes: worst case (max PSNR, NN of that image) first,
    then means; steps run and how many inversions met the tolerance."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r["n"], r["attack"]), []).append(r)
    lines = ["| setting | n | attack | max PSNR dB | NN@max | prior max dB | PSNR dB | "
             "prior dB | SSIM | NN = true | steps | converged |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (setting, n, kind), rs in groups.items():
        top = max(rs, key=lambda r: r["psnr_best"])
        m = {k: sum(r[k] for r in rs) / len(rs) for k in
             ("psnr", "prior_psnr", "ssim", "nearest_is_true")}
        steps = ("-" if "steps_run" not in rs[0] else
                 f"{min(r['steps_run'] for r in rs)}-{max(r['steps_run'] for r in rs)}")
        conv = "-" if "converged" not in rs[0] else f"{sum(r['converged'] for r in rs)}/{len(rs)}"
        lines.append(f"| {setting} | {n} | {kind} | {top['psnr_best']:.2f} | "
                     f"{'yes' if top['nearest_of_best'] else 'no'} | "
                     f"{max(r['prior_psnr_best'] for r in rs):.2f} | {m['psnr']:.2f} | "
                     f"{m['prior_psnr']:.2f} | {m['ssim']:.3f} | {m['nearest_is_true']:.2f} | "
                     f"{steps} | {conv} |")
    return "\n".join(lines)


def plot_traces(traces: list[dict], path: Path) -> None:
    from privfedcal.report.style.plotstyle import new_figure, save, series_style, styled

    with styled():
        fig = new_figure(9, 3.4)
        axes = fig.subplots(1, 2)
        for i, key in enumerate(dict.fromkeys((t["attack"], t["n"]) for t in traces)):
            ts = [t for t in traces if (t["attack"], t["n"]) == key]
            steps = [t["step"] for t in ts]
            label = f"{key[0]} n={key[1]}"
            style = series_style(i, markers=False)
            axes[0].plot(steps, [t["psnr"] for t in ts], **style, label=label + " mean")
            axes[0].plot(steps, [t["psnr_best"] for t in ts], color=style["color"], ls=":",
                         lw=1)
            axes[1].plot(steps, [t["nearest_is_true"] for t in ts], **style, label=label)
        axes[0].set_ylabel("PSNR dB (mean; dotted: best image)")
        axes[1].set_ylabel("nearest training image = true")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("Adam steps (run stops at the convergence criterion)")
        axes[1].legend(fontsize=7)
        save(fig, path, dpi=110)


def main() -> None:
    from privfedcal.attacks.reconstruction.feature_inversion import DEFAULT_MAX_STEPS

    p = harness.parser(__doc__)
    p.add_argument("--run", type=Path, default=None, help="a CCVR run folder (default: train)")
    p.add_argument("--out", type=Path, default=Path("runs/audit-findings"))
    p.add_argument("--parts", type=lambda s: [t for t in s.split(",") if t],
                   default=["plain", "grad", "dp", "secagg"], help=f"of {', '.join(PARTS)}")
    p.add_argument("--ns", type=lambda s: [int(t) for t in s.split(",")],
                   default=[1, 2, 3, 10, 30])
    p.add_argument("--classes", type=lambda s: [int(t) for t in s.split(",")], default=[0, 3])
    p.add_argument("--eps", type=lambda s: [float(t) for t in s.split(",") if t != "none"],
                   default=[1.0, 2.0, 4.0, 8.0], help="DP epsilons (none: skip DP)")
    p.add_argument("--rounds", type=int, default=10, help="rounds of the trained run")
    p.add_argument("--steps", type=int, default=DEFAULT_MAX_STEPS, help="step cap")
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--tv", type=float, default=None,
                   help="TV weight of the feature inversions (default: the library's)")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam step of the feature inversions (default: the library's)")
    p.add_argument("--jitter", type=int, default=None,
                   help="jitter of the feature inversions in pixels (default: the library's)")
    p.add_argument("--init-scale", type=float, default=None,
                   help="start pixels uniform in 0.5 +- s/2 (default: the library's, 1)")
    p.add_argument("--rank-max", type=int, default=3, help="largest n for rank-n recovery")
    p.add_argument("--update-n", type=int, default=None,
                   help="--parts update: keep this many of the smallest client's images")
    p.add_argument("--creff-run", type=Path, default=None,
                   help="a CReFF run folder for --parts rounds (default: train one)")
    p.add_argument("--rounds-combined", type=int, default=3,
                   help="CReFF releases combined by --parts rounds")
    p.add_argument("--max-n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = harness.parse(p)
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; valid: {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, traces = run_findings(args)
    tag = "-".join(args.parts)
    text = table(rows) if rows else ""
    print(text)

    def plain(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    found = [{k: plain(v) for k, v in r.items()} for r in rows + traces]
    (args.out / f"findings-{tag}.json").write_text(json.dumps(found, indent=1))
    (args.out / f"findings-{tag}.md").write_text(text + "\n")
    if traces:
        plot_traces(traces, args.out / "steps.png")
    harness.finish(args, {"rows": found})


if __name__ == "__main__":
    main()
