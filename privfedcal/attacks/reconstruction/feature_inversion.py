"""Feature inversion: images whose features match what a client uploaded.

Threat model: an honest-but-curious server that knows the global extractor ``f`` and sees
a raw feature, a class mean (CCVR appendix C inverts the mean of 3 features), or the class
statistics (n, mu, Sigma) that CCVR uploads. The optimisation follows Mahendran & Vedaldi
(2015, the method CCVR's appendix uses) with the usual strengthening: Adam on images in the
normalised input space, box constraint (clamp to the image of [0,1] after every step),
total variation and a small L2 prior, optional random jitter, several restarts run as one batch
(the best by final objective is kept), and DeepInversion's BatchNorm prior (Yin et al.
2020: the batch mean/variance of every BN input matched to its running statistics).

What is inverted (``FeatureTarget``, and why statistics pin features down) lives in
``feature_targets.py``; the objective's terms and the convergence measure in
``feature_losses.py``; the batched optimiser in ``engine.py``. This module poses targets,
groups them by loss term and runs the optimisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# the optimiser's settings and result live with the optimiser (attacks/reconstruction/engine.py), which
# this module drives; they are re-exported here, where callers configure an inversion
from privfedcal.attacks.reconstruction.engine import DEFAULT_ATTACK_BATCH as DEFAULT_ATTACK_BATCH
from privfedcal.attacks.reconstruction.engine import DEFAULT_MAX_STEPS as DEFAULT_MAX_STEPS
from privfedcal.attacks.reconstruction.engine import Convergence as Convergence
from privfedcal.attacks.reconstruction.engine import InversionConfig as InversionConfig
from privfedcal.attacks.reconstruction.engine import Outcome, optimise_batch
from privfedcal.attacks.reconstruction.engine import channel_stats as channel_stats
from privfedcal.attacks.reconstruction.engine import total_variation as total_variation
from privfedcal.attacks.reconstruction.feature_losses import (
    BNPrior,
    masked_mean,
    raw_loss,
    relative_feature_error,
    stats_loss,
)

# what is inverted (feature_targets.py) is re-exported here too, beside the inversion
from privfedcal.attacks.reconstruction.feature_targets import STATS_MODES as STATS_MODES
from privfedcal.attacks.reconstruction.feature_targets import TARGET_KINDS as TARGET_KINDS
from privfedcal.attacks.reconstruction.feature_targets import FeatureTarget as FeatureTarget
from privfedcal.attacks.reconstruction.feature_targets import PosedTarget, pose
from privfedcal.attacks.reconstruction.feature_targets import (
    features_from_stats as features_from_stats,
)
from privfedcal.attacks.reconstruction.feature_targets import shape_of as shape_of
from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier


@dataclass(frozen=True, eq=False)
class InversionResult:
    images: Tensor  # (B, C, H, W) pixel space [0, 1]
    features: Tensor  # (B, d) features of the returned images
    cosine: float  # per-image targets: mean cos; mean-only targets: cos(batch mean, mu)
    loss: float  # final objective (data term + priors) of the kept restart
    restart_losses: Tensor  # (R,)
    mode: str
    target_features: Tensor | None = None  # per-image feature targets (raw / from stats)
    convergence: Convergence | None = None


def to_pixels(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Normalised input space -> pixel space, clamped to [0, 1]."""
    m, s = channel_stats(mean, std, x.shape[1], x.device, x.dtype)
    return (x * s + m).clamp(0, 1)


def optimise_images(
    objective: Callable[[Tensor], Tensor],
    *,
    restarts: int,
    batch: int,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    config: InversionConfig,
    generator: torch.Generator,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    error: Callable[[Tensor], Tensor] | None = None,
    trace: Callable[[int, Tensor], None] | None = None,
) -> tuple[Tensor, Tensor, int, Convergence]:
    """Shared engine: minimise ``objective(x) -> (restarts,)`` over R*B images in normalised
    space, plus the TV / L2 priors, with jitter and the box constraint.

    ``error(x) -> (restarts,)`` is the relative feature error of each restart (no gradient
    needed); it drives the convergence test (see ``InversionConfig``). Host syncs happen
    only at the checks, every ``config.check_every`` steps. ``trace(step, x_best)``, if
    given, sees the best restart's images (normalised) at every check and at the end.

    Returns ``(x_best (B,C,H,W) normalised, final losses (R,), best restart, convergence)``.
    """

    (out,) = optimise_batch(
        lambda x, _active, _valid: objective(x.flatten(0, 2))[None],
        batches=[batch], restarts=restarts, image_shape=image_shape, mean=mean, std=std,
        config=config, generators=[generator], device=device, dtype=dtype,
        error=None if error is None else (lambda x, _a, _v: error(x.flatten(0, 2))[None]),
        traces=None if trace is None else [trace])
    return out.images, out.losses, out.best, out.convergence


def _stack(rows: list[Tensor], bmax: int) -> Tensor:
    """(B_t, d) per-image targets -> (T, Bmax, d), padded with ones (never scored)."""
    out = rows[0].new_ones(len(rows), bmax, rows[0].shape[-1])
    for t, row in enumerate(rows):
        out[t, : row.shape[0]] = row
    return out


def _in_pixels(trace: Callable[[int, Tensor], None], mean: Sequence[float],
               std: Sequence[float]) -> Callable[[int, Tensor], None]:
    """``trace`` fed pixels instead of the normalised images the optimiser holds."""
    return lambda step, xb: trace(step, to_pixels(xb, mean, std))


def _same_term(rows: list[Tensor | None]) -> list[Tensor] | None:
    """One field of targets that share a ``PosedTarget.term``: set in all, or None when
    the term does not use it."""
    if rows[0] is None:
        return None
    present = [row for row in rows if row is not None]
    if len(present) != len(rows):
        raise ValueError("targets of one batched optimisation mix objective terms")
    return present


def _invert_group(model: FeatureClassifier, posed: list[PosedTarget],
                  generators: Sequence[torch.Generator], cfg: InversionConfig,
                  image_shape: Sequence[int], mean: Sequence[float], std: Sequence[float],
                  traces: Sequence[Callable[[int, Tensor], None] | None] | None,
                  ) -> list[InversionResult]:
    """One batched optimisation over targets with the same ``PosedTarget.term``."""

    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    batches = [p.batch for p in posed]
    bn = BNPrior(model, max(batches)) if cfg.bn_weight > 0 else None
    objective, error = _group_objective(model, posed, cfg.restarts, cfg.bn_weight, bn)
    with eval_mode(model):
        try:
            outs = optimise_batch(
                objective, batches=batches, restarts=cfg.restarts, image_shape=image_shape,
                mean=mean, std=std, config=cfg, generators=generators, device=device,
                dtype=dtype, error=error, traces=None if traces is None else [
                    None if tr is None else _in_pixels(tr, mean, std) for tr in traces])
        finally:
            if bn is not None:
                bn.remove()
        return [_group_result(model, p, out, mean, std)
                for p, out in zip(posed, outs, strict=True)]


_BatchObjective = Callable[[Tensor, Tensor, Tensor], Tensor]


def _group_objective(model: FeatureClassifier, posed: list[PosedTarget], r: int,
                     bn_weight: float, bn: BNPrior | None
                     ) -> tuple[_BatchObjective, _BatchObjective]:
    """(objective, error) of ``optimise_batch`` for targets of one ``PosedTarget.term``:
    the feature loss of each (target, restart) against its target (per-image features,
    mean and covariance, or mean), plus the BatchNorm prior; the error is the relative
    feature error (``relative_feature_error``)."""
    batches = [p.batch for p in posed]
    bmax = max(batches)
    padded = len(set(batches)) > 1
    rows, mus, covs = (_same_term([p.per_image for p in posed]),
                       _same_term([p.mu for p in posed]), _same_term([p.cov for p in posed]))
    per_image = None if rows is None else _stack(rows, bmax)  # (T, Bmax, d)
    mu = None if mus is None else torch.stack(mus)  # (T, d)
    cov = None if covs is None else torch.stack(covs)

    def features(x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor | None]:
        """(A, R, Bmax, d) features of x, and the mask (A, 1, Bmax) when padded. Padding
        images do not go through the model (their features are zeros, masked out)."""
        if not padded:
            return model.features(x.flatten(0, 2)).view(*x.shape[:3], -1), None
        # positions of the valid images in the flat (A * R * Bmax) layout
        idx = torch.nonzero(valid[:, None].expand(-1, r, -1).reshape(-1))[:, 0]
        if bn is not None:
            bn.groups = x.shape[0] * r
            bn.group_ids = torch.div(idx, bmax, rounding_mode="floor")
        flat = x.flatten(0, 2)
        zv = model.features(flat.index_select(0, idx))
        z = zv.new_zeros(flat.shape[0], zv.shape[-1]).index_copy(0, idx, zv)
        return z.view(*x.shape[:3], -1), valid[:, None]

    def data_term(z: Tensor, act: Tensor, mask: Tensor | None) -> Tensor:
        if per_image is not None:
            return raw_loss(z, per_image[act][:, None], mask)
        if mu is None:
            raise ValueError("a mean or class-stats target without its mean")
        if cov is not None:
            return stats_loss(z, mu[act][:, None], cov[act][:, None], mask)
        m, _ = masked_mean(z, mask)
        return raw_loss(m[..., None, :], mu[act][:, None, None])

    def objective(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        z, mask = features(x, valid)
        loss = data_term(z, act, mask)
        bn_loss = bn.pop() if bn is not None else None
        return loss if bn_loss is None else loss + bn_weight * bn_loss.view(loss.shape)

    def error(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        with torch.no_grad():
            z, mask = features(x, valid)
            if bn is not None:
                bn.pop()  # this forward is not part of the objective
            return relative_feature_error(
                z, per_image=None if per_image is None else per_image[act][:, None],
                mu=None if mu is None else mu[act][:, None],
                cov=None if cov is None else cov[act][:, None], valid=mask)

    return objective, error


def _group_result(model: FeatureClassifier, p: PosedTarget, out: Outcome,
                  mean: Sequence[float], std: Sequence[float]) -> InversionResult:
    """A target's result from its ``Outcome``: pixels, features and their cosine to the
    target (per image, or of the mean)."""
    with torch.no_grad():
        z = model.features(out.images)
    if p.per_image is not None:
        cosine = F.cosine_similarity(z, p.per_image, dim=-1).mean()
    elif p.mu is not None:
        cosine = F.cosine_similarity(z.mean(0), p.mu, dim=0)
    else:
        raise ValueError("a posed target needs per-image features or a mean")
    return InversionResult(
        images=to_pixels(out.images, mean, std), features=z, cosine=float(cosine),
        loss=float(out.losses[out.best]), restart_losses=out.losses, mode=p.mode,
        target_features=p.per_image, convergence=out.convergence)


def invert_features_many(
    model: FeatureClassifier,
    targets: Sequence[FeatureTarget],
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generators: Sequence[torch.Generator],
    config: InversionConfig | None = None,
    traces: Sequence[Callable[[int, Tensor], None] | None] | None = None,
) -> list[InversionResult]:
    """``invert_features`` of several targets through one model state, optimised together
    (``engine.optimise_batch``): targets of the same kind of loss term share one batch,
    each with its own generator, stopping step and best restart, so every result is the
    one ``invert_features`` gives for that target alone (up to float rounding)."""
    if len(generators) != len(targets) or (traces is not None and len(traces) != len(targets)):
        raise UsageError("need one generator (and trace, if any) per target")
    cfg = config or InversionConfig()
    param = next(model.parameters())
    posed = [pose(t, param.device, param.dtype) for t in targets]
    results: list[InversionResult | None] = [None] * len(targets)
    for term in dict.fromkeys(p.term for p in posed):
        idx = [i for i, p in enumerate(posed) if p.term == term]
        outs = _invert_group(model, [posed[i] for i in idx], [generators[i] for i in idx], cfg,
                             image_shape, mean, std,
                             None if traces is None else [traces[i] for i in idx])
        for i, res in zip(idx, outs, strict=True):
            results[i] = res
    done = [res for res in results if res is not None]
    if len(done) != len(targets):
        raise RuntimeError("an inversion target was left without a result")
    return done


def invert_features(
    model: FeatureClassifier,
    target: FeatureTarget,
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    steps: int | None = None,
    lr: float | None = None,
    restarts: int | None = None,
    tv_weight: float | None = None,
    l2_weight: float | None = None,
    jitter: int | None = None,
    bn_weight: float | None = None,
    init_scale: float | None = None,
    config: InversionConfig | None = None,
    trace: Callable[[int, Tensor], None] | None = None,
) -> InversionResult:
    """Invert ``target`` through ``model.features``; keywords override ``config``.
    ``trace(step, pixels)`` sees the best restart's images at every convergence check."""
    given: dict[str, Any] = dict(
        steps=steps,
        lr=lr,
        restarts=restarts,
        tv_weight=tv_weight,
        l2_weight=l2_weight,
        jitter=jitter,
        bn_weight=bn_weight,
        init_scale=init_scale,
    )
    overrides = {k: v for k, v in given.items() if v is not None}
    cfg = dataclasses.replace(config or InversionConfig(), **overrides)
    (res,) = invert_features_many(model, [target], image_shape=image_shape, mean=mean, std=std,
                                  generators=[generator], config=cfg,
                                  traces=None if trace is None else [trace])
    return res
