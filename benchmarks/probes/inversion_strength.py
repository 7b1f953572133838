"""Is the feature inversion weak because of its settings? A sweep on raw features (n = 1).

For each class of ``--classes``, one training image of that class is picked exactly as
``benchmarks/attacks/audit_findings.py`` picks its n = 1 set (the client holding most of the class,
seeded), its feature under the run's statistics-release extractor is the target, and
``invert_features`` runs once per setting of the grid ``--tv`` x ``--lr`` x ``--restarts``
(the library's stopping rule, cap ``--steps``). Every reconstruction is scored with
``attacks.report.score`` (paired with its image): PSNR, SSIM, nearest training image =
true, feature cosine, and the data-free prior under the same rule. A strong setting has a
higher PSNR / SSIM and nearest = true; the feature error and stop reason say whether the
optimiser or the prior limits it.

Run: ``python benchmarks/probes/inversion_strength.py --run RUN --out DIR --classes 3,0,1
--tv 1e-3,1e-2,1e-1 --lr 0.1 --restarts 1``. Writes strength-<tag>.json / .md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch

from privfedcal.attacks.reconstruction.feature_inversion import (
    DEFAULT_MAX_STEPS,
    FeatureTarget,
    InversionConfig,
    invert_features,
)
from privfedcal.attacks.reconstruction.runner import load_run
from privfedcal.attacks.reconstruction.scoring import score
from privfedcal.calibration.ccvr import CCVR_RELEASE as STATS_LABEL
from privfedcal.seeding import make_generator

KEYS = ("psnr", "ssim", "feature_cosine", "nearest_is_true", "prior_psnr")


def floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t]


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def pick(view, cls: int, seed: int) -> torch.Tensor:
    """The n = 1 set of ``audit_findings.py`` for class ``cls`` (same owner, same draw)."""
    owner = int(view.truth_exp.counts[:, cls].argmax())
    pool = view.truth(owner, cls)
    g = make_generator(seed, cls, 1, 72)
    return pool[torch.randperm(pool.numel(), generator=g)[:1]]


def sweep(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    view = load_run(args.run)
    rel = view.release(STATS_LABEL, None)
    view.load_state(rel.state)
    model, d = view.model, view.truth_exp.data
    rows = []
    for cls in args.classes:
        idx = pick(view, cls, args.seed)
        with torch.no_grad():
            target = FeatureTarget.raw(model.features(d.x_train[idx]))
        grid = itertools.product(args.tv, args.lr, args.restarts, args.jitter, args.init)
        for tv, lr, restarts, jitter, init in grid:
            cfg = InversionConfig(steps=args.steps, lr=lr, restarts=restarts, tv_weight=tv,
                                  jitter=None if jitter < 0 else jitter, init_scale=init)
            t0 = time.perf_counter()
            # the same generator for every setting of a class: settings differ only in
            # what is swept (restarts > 1 add starts after the first draw's)
            res = invert_features(model, target, image_shape=d.x_train.shape[1:], mean=d.mean,
                                  std=d.std, generator=make_generator(args.seed, 100 * cls + 1,
                                                                     0, 71), config=cfg)
            secs = time.perf_counter() - t0
            rec, _ = score(view, res.images, idx, paired=True)
            row = {"class": cls, "index": int(idx[0]), "tv": tv, "lr": lr,
                   "restarts": restarts, "init_scale": init,
                   "jitter": cfg.jitter_for(*d.x_train.shape[-2:]), **{k: rec[k] for k in KEYS},
                   **res.convergence.as_record(), "seconds": secs}
            rows.append(row)
            print(f"class {cls} tv {tv:g} lr {lr:g} R {restarts} jitter {row['jitter']} init {init:g}: PSNR {row['psnr']:6.2f} "
                  f"SSIM {row['ssim']:.3f} NN {row['nearest_is_true']:.0f} cos "
                  f"{row['feature_cosine']:.3f} (prior {row['prior_psnr']:.2f}) steps "
                  f"{row['steps_run']} {row['stopped']} err {row['feature_error']:.2g} "
                  f"{secs:.0f}s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| class | TV | lr | restarts | jitter | init | PSNR dB | SSIM | NN = true | feature cos | "
             "prior dB | steps | stopped | rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['class']} | {r['tv']:g} | {r['lr']:g} | {r['restarts']} | "
                     f"{r['jitter']} | {r['init_scale']:g} | {r['psnr']:.2f} | {r['ssim']:.3f} | "
                     f"{'yes' if r['nearest_is_true'] else 'no'} | {r['feature_cosine']:.3f} | "
                     f"{r['prior_psnr']:.2f} | {r['steps_run']} | {r['stopped']} | "
                     f"{r['feature_error']:.2g} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True, help="a CCVR run folder with transcript")
    p.add_argument("--out", type=Path, default=Path("runs/inversion-strength"))
    p.add_argument("--classes", type=ints, default=[3, 0, 1])
    p.add_argument("--tv", type=floats, default=[1e-3, 1e-2, 1e-1])
    p.add_argument("--lr", type=floats, default=[0.1])
    p.add_argument("--restarts", type=ints, default=[1])
    p.add_argument("--jitter", type=ints, default=[-1],
                   help="max shift in pixels per step (-1: the library's rule, side // 16)")
    p.add_argument("--init", type=floats, default=[1.0],
                   help="init_scale: start pixels uniform in 0.5 +- s/2 (1: uniform [0, 1])")
    p.add_argument("--steps", type=int, default=DEFAULT_MAX_STEPS, help="step cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="sweep")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = sweep(args)
    text = table(rows)
    print(text)

    def plain(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    (args.out / f"strength-{args.tag}.json").write_text(
        json.dumps([{k: plain(v) for k, v in r.items()} for r in rows], indent=1))
    (args.out / f"strength-{args.tag}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
