"""Feature inversion: images whose features match what a client uploaded.

Threat model: an honest-but-curious server that knows the global extractor ``f`` and sees
a raw feature, a class mean (CCVR appendix C inverts the mean of 3 features), or the class
statistics (n, mu, Sigma) that CCVR uploads. The optimisation follows Mahendran & Vedaldi
(2015, the method CCVR's appendix uses) with the usual strengthening: Adam on images in the
normalised input space, box constraint (clamp to the image of [0,1] after every step),
total variation and a small L2 prior, optional random jitter, several restarts run as one batch
(the best by final objective is kept), and DeepInversion's BatchNorm prior (Yin et al.
2020: the batch mean/variance of every BN input matched to its running statistics).

Statistics pin features down (docs/privacy-audit.md): with ``D`` the n x d matrix of
centred features, ``D^T D = (n-1) Sigma`` and ``1^T D = 0``, so D is known up to a rotation
inside the (n-1)-dimensional space orthogonal to ``1``. For n = 2 there is no freedom left
but the order: ``z = mu +- sqrt(lambda/2) v`` (lambda, v: top eigenpair of Sigma). Hence
``class-stats`` either matches mean AND unbiased covariance of a batch of n images
(``direct``) or first recovers the features and inverts each (``features``; used
automatically for n <= 2, where it is exact).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# the optimiser's settings and result live with the optimiser (attacks/engine.py), which
# this module drives; they are re-exported here, where callers configure an inversion
from privfedcal.attacks.engine import DEFAULT_ATTACK_BATCH as DEFAULT_ATTACK_BATCH
from privfedcal.attacks.engine import DEFAULT_MAX_STEPS as DEFAULT_MAX_STEPS
from privfedcal.attacks.engine import Convergence as Convergence
from privfedcal.attacks.engine import InversionConfig as InversionConfig
from privfedcal.attacks.engine import channel_stats as channel_stats
from privfedcal.attacks.engine import optimise_batch
from privfedcal.attacks.engine import total_variation as total_variation
from privfedcal.attacks.modes import eval_mode
from privfedcal.errors import UsageError
from privfedcal.models.base import FeatureClassifier

TARGET_KINDS = ("raw-feature", "class-mean", "class-stats")
STATS_MODES = ("auto", "direct", "features")


@dataclass(frozen=True, eq=False)
class FeatureTarget:
    """What the attacker inverts. Build with ``raw``, ``class_mean`` or ``class_stats``."""

    kind: str
    z: Tensor | None = None  # raw-feature: (d,) or (k, d) independent features
    mean: Tensor | None = None  # class-mean / class-stats: (d,)
    cov: Tensor | None = None  # class-stats: (d, d) unbiased covariance
    n: int = 1  # number of samples behind mean / stats
    batch: bool = False  # class-mean: n images whose mean feature matches (else one image)
    mode: str = "auto"  # class-stats: auto | direct | features

    def __post_init__(self) -> None:
        if self.kind not in TARGET_KINDS:
            raise UsageError(f"unknown target kind {self.kind!r}; valid: {', '.join(TARGET_KINDS)}")
        if self.n < 1:
            raise UsageError(f"a target needs n >= 1 samples, got {self.n}")
        if self.kind == "raw-feature":
            if self.z is None or self.z.dim() not in (1, 2):
                raise UsageError("raw-feature target needs z of shape (d,) or (k, d)")
        elif self.mean is None or self.mean.dim() != 1:
            raise UsageError(f"{self.kind} target needs a mean of shape (d,)")
        if self.kind == "class-stats":
            d = self.mean.shape[0]  # type: ignore[union-attr]
            if self.cov is None or self.cov.shape != (d, d):
                raise UsageError(f"class-stats target needs cov of shape ({d}, {d})")
            if self.mode not in STATS_MODES:
                raise UsageError(
                    f"unknown stats mode {self.mode!r}; valid: {', '.join(STATS_MODES)}"
                )

    @classmethod
    def raw(cls, z: Tensor) -> FeatureTarget:
        return cls("raw-feature", z=z)

    @classmethod
    def class_mean(cls, mean: Tensor, n: int = 1, *, batch: bool = False) -> FeatureTarget:
        return cls("class-mean", mean=mean, n=n, batch=batch)

    @classmethod
    def class_stats(cls, n: int, mean: Tensor, cov: Tensor, *, mode: str = "auto") -> FeatureTarget:
        return cls("class-stats", mean=mean, cov=cov, n=n, mode=mode)


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


def features_from_stats(n: int, mean: Tensor, cov: Tensor) -> Tensor:
    """The n features implied by (n, mean, unbiased cov), as an (n, d) tensor.

    Exact (up to order) for n <= 2. For n > 2 the result has exactly the given mean and
    the best rank-(n-1) approximation of cov, built on a fixed Helmert contrast basis; the
    true set equals it only up to an unknown rotation of that basis, so individual features
    are not identified by the statistics alone.
    """
    if n < 1:
        raise UsageError(f"n must be >= 1, got {n}")
    mu = mean.double()
    if n == 1:
        return mu[None].to(mean.dtype)
    evals, evecs = torch.linalg.eigh(cov.double())
    k = min(n - 1, mu.shape[0])
    evals, evecs = evals.flip(0)[:k].clamp_min(0), evecs.flip(1)[:, :k]
    # Helmert basis: n x (n-1), orthonormal columns orthogonal to the all-ones vector.
    q = torch.zeros(n, n - 1, dtype=torch.float64, device=mu.device)
    for j in range(1, n):
        q[:j, j - 1] = 1.0 / math.sqrt(j * (j + 1))
        q[j, j - 1] = -j / math.sqrt(j * (j + 1))
    centred = q[:, :k] * torch.sqrt((n - 1) * evals) @ evecs.T
    return (mu + centred).to(mean.dtype)


def to_pixels(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Normalised input space -> pixel space, clamped to [0, 1]."""
    m, s = channel_stats(mean, std, x.shape[1], x.device, x.dtype)
    return (x * s + m).clamp(0, 1)





class _BNPrior:
    """Forward hooks that record, per restart group of ``per_group`` images, how far BN
    input statistics are from the running statistics (DeepInversion's R_feature, L2
    norms). ``group_ids`` (N,), when set, names the group of each input image instead
    (groups of different sizes: a batch of targets without its padding)."""

    def __init__(self, model: nn.Module, per_group: int) -> None:
        self.per_group, self.loss = per_group, None
        self.group_ids: Tensor | None = None
        self.groups = 0
        self.handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
        ]

    def _hook(self, module: nn.Module, inputs: tuple[Tensor, ...], _out: Tensor) -> None:
        x = inputs[0]
        if self.group_ids is None:
            groups = x.shape[0] // self.per_group
            h = x.reshape(groups, self.per_group, x.shape[1], -1).transpose(1, 2).flatten(2)
            if h.shape[-1] < 2:
                return  # one value per channel: no batch statistics to match
            mean, var = h.mean(-1), h.var(-1, unbiased=False)
            enough = None
        else:  # the same two-pass statistics, summed per group with index_add
            ids, h = self.group_ids, x.flatten(2)  # (N, C, S)
            count = h.new_zeros(self.groups).index_add_(
                0, ids, h.new_ones(h.shape[0])) * h.shape[-1]
            mean = h.new_zeros(self.groups, h.shape[1]).index_add_(0, ids, h.sum(-1))
            mean = mean / count[:, None]
            dev = (h - mean[ids][..., None]).pow(2).sum(-1)
            var = h.new_zeros(self.groups, h.shape[1]).index_add_(0, ids, dev) / count[:, None]
            enough = (count >= 2).to(h.dtype)  # as above: a single value adds nothing
        term = (mean - module.running_mean).norm(dim=-1) + (var - module.running_var).norm(dim=-1)
        term = term if enough is None else term * enough
        self.loss = term if self.loss is None else self.loss + term

    def pop(self) -> Tensor | None:
        loss, self.loss = self.loss, None
        return loss

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


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


def _masked_mean(z: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Mean over the image dim -2 of (..., B, d) features, and the valid-image weights
    (..., B, 1) (None: every image counts)."""
    if valid is None:
        return z.mean(-2), None
    w = valid[..., None].to(z.dtype)
    return (z * w).sum(-2) / w.sum(-2), w


def relative_feature_error(
    z: Tensor, *, per_image: Tensor | None = None, mu: Tensor | None = None,
    cov: Tensor | None = None, valid: Tensor | None = None,
) -> Tensor:
    """Relative feature error per restart of (..., R, B, d) features, the convergence
    measure: per-image targets (..., B, d) ``max_i ||z_i - t_i|| / ||t_i||``; a mean
    ``||mean_i z_i - mu|| / ||mu||``; mean and covariance the larger of that and
    ``||Sigma_hat - Sigma||_F / ||Sigma||_F``. Leading target dims broadcast against
    ``mu`` (..., 1, d) / ``cov`` (..., 1, d, d); ``valid`` (..., 1, B) masks padding."""
    def rel(a: Tensor, b: Tensor) -> Tensor:
        return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)

    if per_image is not None:
        err = rel(z, per_image.expand_as(z))
        return (err if valid is None else err.masked_fill(~valid, -math.inf)).amax(-1)
    m, w = _masked_mean(z, valid)
    err = rel(m, mu.expand_as(m))  # type: ignore[union-attr]
    if cov is None:
        return err
    centred = z - m[..., None, :]
    if w is None:
        sigma = centred.transpose(-1, -2) @ centred / max(z.shape[-2] - 1, 1)
    else:
        centred = centred * w
        sigma = centred.transpose(-1, -2) @ centred / (w.sum(-2)[..., None] - 1).clamp_min(1)
    cerr = (sigma - cov).flatten(-2).norm(dim=-1) / cov.flatten(-2).norm(dim=-1).clamp_min(1e-12)
    return torch.maximum(err, cerr)


def _raw_loss(z: Tensor, target: Tensor, valid: Tensor | None = None) -> Tensor:
    """(..., R, B, d) vs (..., B, d): mean over B of (1 - cos) + squared error relative to
    ||target||^2 (over the ``valid`` (..., 1, B) images only, when given)."""
    cos = F.cosine_similarity(z, target.expand_as(z), dim=-1)
    rel = (z - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-12)
    if valid is None:
        return (1 - cos + rel).mean(-1)
    w = valid.to(z.dtype)
    return ((1 - cos + rel) * w).sum(-1) / w.sum(-1)


def _stats_loss(z: Tensor, mu: Tensor, cov: Tensor, valid: Tensor | None = None) -> Tensor:
    """(..., R, n, d) features vs (mu (..., 1, d), unbiased cov (..., 1, d, d)), each term
    scaled by its target's size; ``valid`` (..., 1, n) masks padding images."""
    m, w = _masked_mean(z, valid)
    centred = z - m[..., None, :]
    if w is None:
        sigma = centred.transpose(-1, -2) @ centred / (z.shape[-2] - 1)
    else:
        centred = centred * w
        sigma = centred.transpose(-1, -2) @ centred / (w.sum(-2)[..., None] - 1)
    trace = cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    mean_term = (m - mu).pow(2).sum(-1) / (mu.pow(2).sum(-1) + trace).clamp_min(1e-12)
    cov_term = (sigma - cov).pow(2).sum((-2, -1)) / cov.pow(2).sum((-2, -1)).clamp_min(1e-12)
    return mean_term + cov_term + (1 - F.cosine_similarity(m, mu.expand_as(m), dim=-1))


@dataclass(frozen=True, eq=False)
class _Posed:
    """A target as the optimiser sees it: per-image feature targets (B, d), or a mean (d,)
    with, for ``class-stats-direct``, an unbiased covariance; ``batch`` images."""

    mode: str
    batch: int
    per_image: Tensor | None = None
    mu: Tensor | None = None
    cov: Tensor | None = None

    @property
    def term(self) -> str:
        """Targets with the same term can share one batched optimisation."""
        return "per-image" if self.per_image is not None else (
            "stats" if self.cov is not None else "mean")


def shape_of(target: FeatureTarget) -> tuple[str, int]:
    """``(term, images)``: the kind of loss term an inversion of ``target`` minimises
    (``per-image`` | ``mean`` | ``stats``; only targets with the same term share a batch)
    and how many images it optimises per restart (``_pose`` decides the same way)."""
    if target.kind == "raw-feature":
        z = target.z
        return "per-image", 1 if z.dim() == 1 else int(z.shape[0])  # type: ignore[union-attr]
    if target.kind == "class-mean":
        return ("mean", target.n) if target.batch and target.n > 1 else ("per-image", 1)
    if target.mode == "features" or (target.mode == "auto" and target.n <= 2) or target.n == 1:
        return "per-image", target.n
    return "stats", target.n


def _pose(target: FeatureTarget, device: torch.device, dtype: torch.dtype) -> _Posed:
    per_image: Tensor | None = None
    mu = cov = None
    if target.kind == "raw-feature":
        per_image, mode = target.z.reshape(-1, target.z.shape[-1]), "raw-feature"  # type: ignore[union-attr]
    elif target.kind == "class-mean":
        if target.batch and target.n > 1:
            mu, mode = target.mean, "class-mean-batch"
        else:
            per_image, mode = target.mean[None], "class-mean"  # type: ignore[index]
    elif target.mode == "features" or (target.mode == "auto" and target.n <= 2) or target.n == 1:
        per_image = features_from_stats(target.n, target.mean, target.cov)  # type: ignore[arg-type]
        mode = "class-stats-features"
    else:
        mu, cov, mode = target.mean, target.cov, "class-stats-direct"
    batch = per_image.shape[0] if per_image is not None else target.n
    return _Posed(mode, batch,
                  None if per_image is None else per_image.to(device, dtype),
                  None if mu is None else mu.to(device, dtype),
                  None if cov is None else cov.to(device, dtype))


def _stack(rows: list[Tensor], bmax: int) -> Tensor:
    """(B_t, d) per-image targets -> (T, Bmax, d), padded with ones (never scored)."""
    out = rows[0].new_ones(len(rows), bmax, rows[0].shape[-1])
    for t, row in enumerate(rows):
        out[t, : row.shape[0]] = row
    return out


def _invert_group(model: FeatureClassifier, posed: list[_Posed],
                  generators: Sequence[torch.Generator], cfg: InversionConfig,
                  image_shape: Sequence[int], mean: Sequence[float], std: Sequence[float],
                  traces: Sequence[Callable[[int, Tensor], None] | None] | None,
                  ) -> list[InversionResult]:
    """One batched optimisation over targets with the same ``_Posed.term``."""

    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    batches = [p.batch for p in posed]
    bmax, r = max(batches), cfg.restarts
    padded = len(set(batches)) > 1
    per_image = _stack([p.per_image for p in posed], bmax) if posed[0].per_image is not None \
        else None  # (T, Bmax, d)
    mu = torch.stack([p.mu for p in posed]) if posed[0].mu is not None else None  # (T, d)
    cov = torch.stack([p.cov for p in posed]) if posed[0].cov is not None else None
    bn = _BNPrior(model, bmax) if cfg.bn_weight > 0 else None

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
            return _raw_loss(z, per_image[act][:, None], mask)
        if cov is not None:
            return _stats_loss(z, mu[act][:, None], cov[act][:, None], mask)  # type: ignore[index]
        m, _ = _masked_mean(z, mask)
        return _raw_loss(m[..., None, :], mu[act][:, None, None])  # type: ignore[index]

    def objective(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        z, mask = features(x, valid)
        loss = data_term(z, act, mask)
        bn_loss = bn.pop() if bn is not None else None
        return loss if bn_loss is None else loss + cfg.bn_weight * bn_loss.view(loss.shape)

    def error(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        with torch.no_grad():
            z, mask = features(x, valid)
            if bn is not None:
                bn.pop()  # this forward is not part of the objective
            return relative_feature_error(
                z, per_image=None if per_image is None else per_image[act][:, None],
                mu=None if mu is None else mu[act][:, None],
                cov=None if cov is None else cov[act][:, None], valid=mask)

    with eval_mode(model):
        try:
            outs = optimise_batch(
                objective, batches=batches, restarts=r, image_shape=image_shape, mean=mean,
                std=std, config=cfg, generators=generators, device=device, dtype=dtype,
                error=error, traces=None if traces is None else [
                    None if tr is None else (lambda step, xb, tr=tr: tr(step, to_pixels(
                        xb, mean, std))) for tr in traces])
        finally:
            if bn is not None:
                bn.remove()
        results = []
        for p, out in zip(posed, outs, strict=True):
            with torch.no_grad():
                z = model.features(out.images)
            if p.per_image is not None:
                cosine = F.cosine_similarity(z, p.per_image, dim=-1).mean()
            else:
                cosine = F.cosine_similarity(z.mean(0), p.mu, dim=0)  # type: ignore[arg-type]
            results.append(InversionResult(
                images=to_pixels(out.images, mean, std), features=z, cosine=float(cosine),
                loss=float(out.losses[out.best]), restart_losses=out.losses, mode=p.mode,
                target_features=p.per_image, convergence=out.convergence))
    return results


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
    posed = [_pose(t, param.device, param.dtype) for t in targets]
    results: list[InversionResult | None] = [None] * len(targets)
    for term in dict.fromkeys(p.term for p in posed):
        idx = [i for i, p in enumerate(posed) if p.term == term]
        outs = _invert_group(model, [posed[i] for i in idx], [generators[i] for i in idx], cfg,
                             image_shape, mean, std,
                             None if traces is None else [traces[i] for i in idx])
        for i, res in zip(idx, outs, strict=True):
            results[i] = res
    return results  # type: ignore[return-value]


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
    given = dict(
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
