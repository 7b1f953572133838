"""CReFF: Classifier Re-training with Federated Features (Shang et al., IJCAI 2022).

Every round: clients upload per-class gradients of the re-trained head ``v_hat`` on their real
features (Eq. 3), the server averages them over the clients holding each class (Eq. 4), moves
learnable "federated features" S so that their gradients (Eq. 5) match the real ones by the
cosine loss of Eq. 6, and re-trains a head on S (Eq. 7). The run evaluates
``(global extractor, v_hat)``.

For a linear softmax head the per-sample gradient is analytic:
``G_i = (softmax(W z_i + b) - e_{y_i}) [z_i, 1]^T`` (C x (d+1)), so clients and server need no
autograd and the matching loss is differentiated through a closed form (equal to
``autograd.grad(..., create_graph=True)``; tested).

What we follow, and where we differ from the paper / the authors' code (docs/methods.md).
Defaults follow the authors' code wherever the paper's tables came from it:

* client gradients use the extractor the clients received this round with ``v_hat`` of the
  previous round; ``initial_head="fresh"`` (authors) makes round 1's ``v_hat`` a fresh head
  drawn like ``nn.Linear``, ``"global"`` uses the global model's initial classifier;
* a client uses at most ``client_draws * draw_size`` (10 x 32) samples per class, drawn
  uniformly without replacement by keys computed from each sample's content (the authors
  average 10 batches of 32 images per class, augmented; same expectation, bounded client
  cost, each sample counted at most once, and a neighbouring dataset changes the draw by one
  swap, so the sensitivity the DP noise assumes holds: ``GradTask``); ``client_draws=None``
  (or 0) uses every sample, the default under DP (``DP_CLIENT_DRAWS``: a cap halves the
  summed gradients to keep their sensitivity, i.e. halves the signal against the noise);
* ``release_last=R``: gradients are released and matched in the last R rounds only
  (``release_schedule``, public config; default every round, as the paper), so that under DP
  the budget composes over R releases (docs/privacy/dp-uploads.md);
* client gradients are computed on images under the authors' differentiable Siamese
  augmentation (``dsa``, default their strategy ``color_crop_cutout_flip_scale_rotate``;
  ``"none"`` turns it off; ``privfedcal/data/dsa.py``): the authors augment each class batch
  of 32 with one transform; here the kept samples of a class fall into ``client_draws``
  groups by a second hash of their content, and each (class, group) gets one transform
  drawn from the round's seed, so a sample's transform never depends on the other samples
  and the sensitivity stays as it is. The server matches federated features in feature
  space, where the authors' code augments nothing, and so does ours;
* ``weighting="client"`` is the paper's unweighted mean over holders (``grad`` = per-class
  mean, ``holders`` indicators); ``"sample"`` uploads sums and counts only, the form DP noise
  and secure aggregation prefer;
* Eq. 6: ``bias_match="term"`` (authors) sums ``1 - cos`` over the C rows of the weight
  gradient plus one term for the whole bias-gradient vector; ``"rows"`` appends each bias
  entry to its weight row (C terms over ``[W | b]``). A bias-free head matches the weight
  rows only. Classes that no selected client holds are skipped. ``match_reduction="sum"``
  (default) sums the terms as the authors' code does, ``"mean"`` divides by C (the paper);
* S is moved by SGD (lr 0.1, no momentum as in the authors' code; ``feature_momentum`` adds
  it, with its buffer kept in ``state_dict``);
* re-training starts every round from a *fresh* head (authors' code) and runs
  ``retrain_steps`` = J units of ``retrain_unit``: ``"epoch"`` (authors: J passes over S in
  shuffled minibatches of ``retrain_batch_size`` 32, lr 0.01) or ``"step"`` (J SGD steps;
  the earlier default was J = 300 full-batch steps at lr 0.1). The head gradient is the
  closed form (``retrain.py``) for a plain linear head;
* all randomness comes from ``ctx.generator``, which the simulator seeds per (seed, round),
  so ``state_dict`` (S, its momentum, v_hat) is all a resume needs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.calibration.ccvr import extract_features
from privfedcal.calibration.draws import (  # noqa: F401  (capped_per_class: re-exported)
    HASH_PRIME,
    capped_per_class,
    content_keys,
    keep_smallest,
)
from privfedcal.calibration.retrain import (
    effective_weight,
    fresh_head,
    read_head,
    retrain_classifier,
    write_head,
)
from privfedcal.data.dsa import AUTHORS_STRATEGY, apply_transforms, draw_transforms, parse_strategy
from privfedcal.errors import UploadRejected, UsageError
from privfedcal.federation.hooks import (
    Bound,
    Calibrator,
    Payload,
    ServerContext,
    State,
)
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.releases import ReleaseSpec
from privfedcal.seeding import derive_seed
from privfedcal.settings.descriptions import calibration_option
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.tensors import all_finite

WEIGHTINGS = ("client", "sample")
REDUCTIONS = ("sum", "mean")
BIAS_MATCHES = ("term", "rows")
RETRAIN_UNITS = ("epoch", "step")
INITIAL_HEADS = ("fresh", "global")


#: CReFF's per-class cap under DP unless ``--creff-client-draws`` is given: 0, every sample.
#: A cap makes adding or removing one example a swap (2G), so capped sums are halved to keep
#: the sensitivity at G, which halves the signal against the same noise; uncapped sums move
#: by G unhalved (docs/threat-model.md, "Neighbours and sensitivities")
DP_CLIENT_DRAWS = 0


def release_schedule(rounds: int, last: int | None) -> tuple[int, ...]:
    """The rounds (1-based) in which CReFF's clients release class gradients: the last
    ``last`` of ``rounds`` (every round when ``last`` is None or 0, or not below
    ``rounds``). A function of the public config alone, so the planner, every client's
    ledger and the server agree on it before training."""
    if rounds < 1:
        return ()
    first = 1 if not last or last >= rounds else rounds - last + 1
    return tuple(range(first, rounds + 1))


@dataclass(frozen=True)
class CReFFParams:
    """Paper: m = 100, I = 100, J = 300, SGD lr 0.1 for the features. The remaining defaults
    follow the authors' code (the paper's tables): re-training for J epochs of batch-32
    minibatches at lr 0.01 from a fresh head, a fresh round-1 ``v_hat``, the bias gradient
    as one more cosine term, summed terms, at most 10 x 32 samples per class on a client,
    differentiable Siamese augmentation of the client's images (``dsa``).

    The earlier recipe (J full-batch steps at lr 0.1, ``v_hat`` from the global classifier,
    bias entries in the rows, all samples) is ``retrain_unit="step", retrain_lr=0.1,
    retrain_batch_size=None, initial_head="global", bias_match="rows", client_draws=None``.
    """

    features_per_class: int = calibration_option(100, "CReFF federated features per class m.")
    match_steps: int = calibration_option(100, "CReFF gradient-matching steps I.")
    retrain_steps: int = calibration_option(300, "CReFF classifier re-training steps J.")
    feature_lr: float = calibration_option(0.1, "CReFF federated-feature learning rate.")
    retrain_lr: float = 0.01
    feature_momentum: float = 0.0
    retrain_batch_size: int | None = 32
    retrain_unit: str = "epoch"
    initial_head: str = "fresh"
    bias_match: str = "term"
    client_draws: int | None = calibration_option(
        10, "CReFF: a client uses at most client_draws x draw_size (32) samples per class "
        "(authors: 10); 0: every sample, which keeps a sum's sensitivity at the clip (a cap "
        f"halves it). Default 10; {DP_CLIENT_DRAWS} under --dp-eps", flag="creff_client_draws")
    draw_size: int = 32
    weighting: str = calibration_option("client", "CReFF g_agg: client (paper) | sample",
                                        flag="creff_weighting")
    match_reduction: str = "sum"
    feature_batch_size: int = 1024
    dsa: str = calibration_option(
        AUTHORS_STRATEGY, "CReFF client-gradient augmentation (DSA): a strategy such as "
        "color_crop_cutout_flip_scale_rotate (authors, default) | none", flag="creff_dsa")
    release_last: int | None = calibration_option(
        None, "CReFF: clients release class gradients (and the server matches them) in the "
        "last R rounds only, so that under --dp-eps the budget composes over R releases; "
        "0 or unset: every round (paper, default)", flag="creff_release_last")
    #: the run's rounds (public config), filled in by ``CReFF.privacy_options``: with
    #: ``release_last`` it fixes the release rounds (``release_schedule``)
    rounds: int | None = None

    def __post_init__(self) -> None:
        parse_strategy(self.dsa)  # refuses an unknown strategy with a one-line UsageError
        for name in ("features_per_class", "feature_batch_size", "draw_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"CReFF {name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        for name in ("match_steps", "retrain_steps"):
            if getattr(self, name) < 0:
                raise UsageError(f"CReFF {name.replace('_', ' ')} must be >= 0, got {getattr(self, name)}")
        for name in ("feature_lr", "retrain_lr"):
            if not getattr(self, name) > 0:
                raise UsageError(f"CReFF {name.replace('_', ' ')} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.feature_momentum < 1:
            raise UsageError(f"CReFF feature momentum must be in [0, 1), got {self.feature_momentum}")
        if self.retrain_batch_size is not None and self.retrain_batch_size < 1:
            raise UsageError(f"CReFF retrain batch size must be >= 1, got {self.retrain_batch_size}")
        if self.release_last is not None and self.release_last < 0:
            raise UsageError(f"CReFF release last must be >= 0 (0: every round), got "
                             f"{self.release_last}")
        if self.client_draws == 0:  # the flag's spelling of "every sample"
            object.__setattr__(self, "client_draws", None)
        if self.client_draws is not None and self.client_draws < 1:
            raise UsageError(f"CReFF client draws must be >= 1 (0 or unset: all samples), got {self.client_draws}")
        for name, choices in (("match_reduction", REDUCTIONS), ("weighting", WEIGHTINGS),
                              ("bias_match", BIAS_MATCHES), ("retrain_unit", RETRAIN_UNITS),
                              ("initial_head", INITIAL_HEADS)):
            if getattr(self, name) not in choices:
                raise UsageError(f"CReFF {name.replace('_', ' ')} must be one of "
                                 f"{', '.join(choices)}, got {getattr(self, name)!r}")

    def num_retrain_steps(self, n: int) -> int:
        """SGD steps of one re-training on ``n`` federated features."""
        if self.retrain_unit == "step":
            return self.retrain_steps
        bs = n if self.retrain_batch_size is None else min(self.retrain_batch_size, n)
        return self.retrain_steps * math.ceil(n / bs)


# ---- pure math -------------------------------------------------------------------------------
def _with_ones(z: Tensor) -> Tensor:
    return torch.cat([z, torch.ones_like(z[..., :1])], dim=-1)


def per_sample_head_grads(z: Tensor, y: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(n, C, d+1): gradient of ``CE(W z_i + b, y_i)`` w.r.t. ``[W | b]`` for every sample."""
    p = torch.softmax(F.linear(z, weight, bias), dim=-1)
    r = p - F.one_hot(y, weight.shape[0]).to(p.dtype)
    return r[:, :, None] * _with_ones(z)[:, None, :]


def class_mean_grads(s: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(C, C, d+1): for ``s`` (C, m, d) with s[c] labelled c, the mean over s[c] of the
    per-sample gradients. Differentiable w.r.t. ``s`` (Eq. 5)."""
    num_classes, m, _ = s.shape
    p = torch.softmax(F.linear(s, weight, bias), dim=-1)                       # (C, m, C)
    r = p - torch.eye(num_classes, dtype=p.dtype, device=p.device)[:, None, :]
    return torch.einsum("cmk,cme->cke", r, _with_ones(s)) / m


def matching_loss(g_fed: Tensor, g_agg: Tensor, mask: Tensor, reduction: str = "mean",
                  bias_match: str = "rows", has_bias: bool = True) -> Tensor:
    """Eq. 6 summed over the classes in ``mask``, for (C, C, d+1) gradients ``[dW | db]``.

    Per class c the terms are ``1 - cos`` of: the C rows of ``[dW | db]`` (``"rows"``), or the
    C rows of ``dW`` plus the bias-gradient vector ``db`` as one more term (``"term"``, the
    authors' code); without a bias (``has_bias=False``) only the C rows of ``dW``. The terms
    are summed (``reduction="sum"``, the authors' code) or divided by C (``"mean"``, the
    paper's 1/C)."""
    g_agg = g_agg.to(g_fed.dtype)
    num_classes = g_fed.shape[1]
    if bias_match == "rows" and has_bias:
        cos = F.cosine_similarity(g_fed, g_agg, dim=-1, eps=1e-8)                  # (C, C)
        per_class = (1 - cos).sum(dim=1)
    else:
        cos = F.cosine_similarity(g_fed[..., :-1], g_agg[..., :-1], dim=-1, eps=1e-8)
        per_class = (1 - cos).sum(dim=1)
        if has_bias:
            cos_b = F.cosine_similarity(g_fed[..., -1], g_agg[..., -1], dim=-1, eps=1e-8)
            per_class = per_class + (1 - cos_b)
    if reduction == "mean":
        per_class = per_class / num_classes
    return (per_class * mask.to(per_class.dtype)).sum()


# ---- client side ----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class GradTask:
    """One client's per-class head gradients (Eq. 3), same shapes whatever classes it holds.

    Payload: ``grad`` (C, C, d+1) and ``count`` (C,) sums for sample weighting; per-class
    mean ``grad`` and ``holders`` (C,) 0/1 indicators for client weighting. Every per-sample
    gradient goes through ``bound.clip`` (kind ``"class-gradient"``) before it is summed.

    The per-class cap keeps the ``cap`` samples of a class with the smallest keys, each key a
    function of the sample's own content (``content_keys``), so adding or removing one
    example changes the kept set by at most one swap. A swap moves a sum of clipped
    gradients by up to twice the clip, so with a cap the summed (sample-weighted) gradients
    are halved: the released ``grad`` then moves by at most the clip G the noise is
    calibrated to (CReFF matches gradient directions, which the halving leaves unchanged).
    A per-class mean over at least 2 kept samples moves by at most 2G/2 = G, unhalved.

    With ``dsa`` (a strategy of ``privfedcal/data/dsa.py``), the kept images are augmented
    before their features are taken (``augment``): each sample's transform depends on its
    own content and the public seed only, so the bounds above hold unchanged.
    """

    weight: Tensor
    bias: Tensor | None
    num_classes: int
    weighting: str = "client"
    batch_size: int = 1024
    per_class_cap: int | None = None
    seed: int = 0
    dsa: str = "none"
    dsa_groups: int = 10

    def public_tensors(self) -> dict[str, Tensor]:
        """The head every client differentiates this round: the server sends it, so the
        transcript records it with the release (the attacks need it; docs/privacy/attacks.md)."""
        return {"head.weight": self.weight} | ({} if self.bias is None else {"head.bias": self.bias})

    def compute(self, model: FeatureClassifier, x: Tensor, y: Tensor, bound: Bound) -> Payload:
        scale = 1.0
        augment = bool(parse_strategy(self.dsa))
        if self.per_class_cap is not None and (self.weighting == "sample"
                                               or self.per_class_cap < 2):
            scale = 0.5  # a swap moves a sum by 2 clips: keep the sensitivity at one
        if self.per_class_cap is not None or augment:
            x, y = self._draw(x, y, augment)
        z = extract_features(model, x, self.batch_size)
        w = self.weight.to(device=z.device, dtype=z.dtype)
        b = None if self.bias is None else self.bias.to(device=z.device, dtype=z.dtype)
        c, width = self.num_classes, self.num_classes * (z.shape[1] + 1)
        y = y.to(device=z.device, dtype=torch.long)
        total = torch.zeros(c, width, dtype=torch.float64, device=z.device)
        chunk = max(1, (1 << 22) // width)      # bounds the (chunk, C, d+1) block in memory
        for i in range(0, z.shape[0], chunk):
            g = per_sample_head_grads(z[i:i + chunk], y[i:i + chunk], w, b).reshape(-1, width)
            total.index_add_(0, y[i:i + chunk], bound.clip(g, "class-gradient").double() * scale)
        count = torch.bincount(y, minlength=c).double()
        grad = total.reshape(c, c, -1)
        if self.weighting == "sample":
            return {"grad": grad, "count": count}
        mean = grad / count.clamp_min(1)[:, None, None]
        return {"grad": mean, "holders": (count > 0).double()}

    def _draw(self, x: Tensor, y: Tensor, augment: bool) -> tuple[Tensor, Tensor]:
        """``(x, y)`` capped per class (``per_class_cap``) and augmented (DSA), both keyed
        by each sample's content."""
        keys = content_keys(x, self.seed)
        if self.per_class_cap is not None:
            keep = keep_smallest(keys, y, self.num_classes, self.per_class_cap)
            if keep is not None:
                x, y, keys = x[keep.to(x.device)], y[keep.to(y.device)], keys[keep]
        if augment:
            x = self.augment(x, y, keys)
        return x, y

    def augment(self, x: Tensor, y: Tensor, keys: Tensor) -> Tensor:
        """``x`` under DSA: sample i gets transform set ``y_i * dsa_groups + group_i``, its
        group a hash of its content (``keys`` mod the prime: independent of the key's high
        part that the cap sorts by), the sets drawn from the round's seed alone. Samples of a
        (class, group) share one transform, as the authors' class batches do."""
        group = torch.remainder(torch.remainder(keys, HASH_PRIME), self.dsa_groups)
        index = y.to("cpu", torch.long) * self.dsa_groups + group
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0x05A))
        t = draw_transforms(self.num_classes * self.dsa_groups, self.dsa, g)
        return apply_transforms(x, t, index)


def task_seed(round_seed: int) -> int:
    """The seed of a round's ``GradTask`` (its content keys and DSA transforms) from the seed
    of the round's generator (``ServerContext.generator.initial_seed()``), which it leaves
    unconsumed. Public, as the run's seed is: the attacks' scoring recomputes the
    augmentation a client applied (attacks/reconstruction/gradients_attack.py)."""
    return (round_seed * 1_000_003 + 17) % 2**63


def aggregate_gradients(payload: Payload, weighting: str, num_classes: int) -> tuple[Tensor, Tensor]:
    """Eq. 4 from the cross-client sum: (g_agg (C, C, d+1), mask of classes someone holds)."""
    key = "count" if weighting == "sample" else "holders"
    if set(payload) != {"grad", key}:
        raise UploadRejected(f"CReFF payload needs keys ['grad', {key!r}], got {sorted(payload)}")
    grad, denom = payload["grad"].double(), payload[key].double()
    if grad.dim() != 3 or grad.shape[:2] != (num_classes, num_classes) or denom.shape != (num_classes,):
        raise UploadRejected(f"CReFF payload shapes grad {tuple(grad.shape)}, {key} {tuple(denom.shape)}")
    if not (all_finite(grad) and all_finite(denom)):
        raise UploadRejected("CReFF payload has NaN/Inf values")
    mask = denom > 0.5
    safe = torch.where(mask, denom, torch.ones_like(denom))
    return grad / safe[:, None, None], mask


# ---- server side ----------------------------------------------------------------------------
#: how CReFF's release splits its noise budget (``dp.noise_stds``): counts and holder
#: indicators only decide which classes are matched (g_agg's per-class scale is lost in the
#: cosine), so they get a tenth and the gradients nine tenths: gradient noise std
#: z G / sqrt(0.9) = 1.05 z G instead of sqrt(2) z G, count noise z / sqrt(0.1) = 3.2 z
#: (docs/privacy/dp-uploads.md)
NOISE_SHARE = {"grad": 0.9, "count": 0.1, "holders": 0.1}

#: the label of CReFF's per-round release: its name in the transcript, the accountant and
#: the reports
CREFF_RELEASE = "creff-grad"


class CReFF(Calibrator):
    """Per-round gradient matching of federated features and head re-training."""

    name: ClassVar[str] = "creff"
    Params: ClassVar[type] = CReFFParams
    arg_field: ClassVar[str] = "features_per_class"
    #: one release per round from its selected clients: sample weighting uploads grad +
    #: count, client weighting grad (per-class means) + holders (docs/threat-model.md)
    releases: ClassVar[tuple[ReleaseSpec, ...]] = (ReleaseSpec(
        CREFF_RELEASE, sensitivity={"grad": "G", "count": "1", "holders": "1"},
        magnitude={"grad": "G*N", "count": "N", "holders": "K"}, participants="selected",
        task=GradTask,
        holds={"grad": "per-class classifier gradients (C, C, d+1)",
               "count": "per-class counts (C,), with --creff-weighting sample",
               "holders": "which classes the client holds (C,) of 0/1, with client "
                          "weighting"},
        noise_share=NOISE_SHARE),)

    # ---- privacy policy -----------------------------------------------------------------
    @staticmethod
    def _weighting_given(privacy: PrivacyOptions) -> bool:
        return any(k in privacy.calibration_params for k in ("creff_weighting", "weighting"))

    @classmethod
    def privacy_options(cls, privacy: PrivacyOptions, options: dict[str, Any]
                        ) -> dict[str, Any]:
        """Under DP, sample weighting unless a weighting was given: client weighting
        uploads per-class means, whose signal does not grow with the data and drowns in the
        noise (docs/results/privacy.md)."""
        options = {**options, "rounds": privacy.rounds}
        given = {k for k, v in privacy.calibration_params.items() if v is not None}
        if privacy.dp_enabled and not given & {"creff_client_draws", "client_draws"}:
            options["creff_client_draws"] = DP_CLIENT_DRAWS
        if privacy.dp_enabled and not cls._weighting_given(privacy):
            return {**options, "creff_weighting": "sample"}
        return options

    @classmethod
    def release_rounds(cls, privacy: PrivacyOptions, spec: Any = None) -> tuple[int, ...]:
        """The rounds of CReFF's class-gradient release: the last ``--creff-release-last``
        rounds (``release_schedule``; every round by default, with or without DP), from the
        public config alone. The calibrator a run builds reads the same two values
        (``privacy_options`` passes it the run's rounds)."""
        params = privacy.calibration_params
        last = next((params[k] for k in ("creff_release_last", "release_last")
                     if params.get(k) is not None), None)
        return release_schedule(privacy.rounds, None if last is None else int(last))

    @classmethod
    def privacy_hints(cls, privacy: PrivacyOptions) -> list[str]:
        if not privacy.dp_enabled:
            return []
        if not cls._weighting_given(privacy):
            return ["under DP, CReFF uses sample weighting (class-gradient sums and counts): "
                    "the paper's client weighting uploads per-class means whose signal does "
                    "not grow with the data and drowns in the noise (docs/results/privacy.md)"]
        params = privacy.calibration_params
        given = params.get("creff_weighting") or params.get("weighting")
        if str(given) != "sample":
            return ["CReFF's client weighting uploads per-class means, whose signal does not "
                    "grow with the data: under DP, --creff-weighting sample is far more "
                    "accurate (docs/results/privacy.md)"]
        return []

    def __init__(self, params: CReFFParams | None = None, *, num_classes: int,
                 feature_dim: int | None = None) -> None:
        self.params = params if params is not None else CReFFParams()
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self.features: Tensor | None = None      # S, (C*m, d), rows of class c contiguous
        self.momentum: Tensor | None = None
        self.weight: Tensor | None = None        # v_hat
        self.bias: Tensor | None = None
        self.last_round_info: dict[str, Any] = {}

    def _start(self, ctx: ServerContext) -> None:
        head = read_head(ctx.sent_state)
        dim = int(head.weight.shape[1])
        rows = self.num_classes * self.params.features_per_class
        s = torch.randn(rows, dim, generator=ctx.generator, device=ctx.generator.device)
        self.features = s.to(ctx.device)
        if self.params.initial_head == "fresh":  # authors' code: round 1 uses a new head
            w, b = fresh_head(self.num_classes, dim, ctx.generator, device=ctx.device)
            self.weight, self.bias = w, None if head.bias is None else b
        else:
            self.weight = head.weight.detach().float().clone()
            self.bias = None if head.bias is None else head.bias.detach().float().clone()

    def releases_in(self, round_: int) -> bool:
        """Whether round ``round_`` releases class gradients (``release_schedule``; every
        round where the run's rounds were not given)."""
        p = self.params
        return p.rounds is None or round_ in release_schedule(p.rounds, p.release_last)

    def after_round(self, ctx: ServerContext) -> None:
        if not self.releases_in(ctx.round):
            # no release this round: S and v_hat stay as they are (before the first
            # release the run evaluates the global model)
            self.last_round_info = {"name": self.name, "released": False}
            return
        t0 = time.perf_counter()
        if self.features is None:
            self._start(ctx)
        features, weight = self.features, self.weight
        if features is None or weight is None:
            raise ValueError("CReFF's state holds features without a head (or the reverse)")
        p, c, m = self.params, self.num_classes, self.params.features_per_class
        normalized = read_head(ctx.sent_state).normalized
        w_eff = effective_weight(weight, normalized).detach()
        bias = None if self.bias is None else self.bias.detach()
        cap = None if p.client_draws is None else p.client_draws * p.draw_size
        # Derived from the round's seed without consuming the stream: where no client holds
        # more than ``cap`` samples of a class, the run is identical to ``client_draws=None``.
        seed = task_seed(ctx.generator.initial_seed())
        task = GradTask(w_eff.cpu(), None if bias is None else bias.cpu(), c, p.weighting,
                        p.feature_batch_size, cap, seed, p.dsa, p.client_draws or 10)
        payload = ctx.collect(task, clients=list(ctx.selected), state=ctx.sent_state,
                              label=CREFF_RELEASE)
        g_agg, mask = aggregate_gradients(payload, p.weighting, c)
        s = features.to(ctx.device).float()
        w_eff, bias = w_eff.to(s.device), None if bias is None else bias.to(s.device)
        g_agg, mask = g_agg.to(s.device, torch.float32), mask.to(s.device)
        dim = s.shape[1]
        s, first, final = self._match_features(s, w_eff, bias, g_agg, mask)

        labels = torch.arange(c, device=s.device).repeat_interleave(m)
        w0, b0 = fresh_head(c, dim, ctx.generator, device=s.device)
        self.weight, self.bias = retrain_classifier(
            w0, None if self.bias is None else b0, s, labels,
            steps=p.num_retrain_steps(len(labels)), lr=p.retrain_lr,
            batch_size=p.retrain_batch_size, generator=ctx.generator, normalized=normalized)
        self.last_round_info = {
            "name": self.name,
            "match_loss_before": None if first is None else float(first),
            "match_loss_after": final,
            "matched_classes": int(mask.sum()),
            "released": True,
            "seconds": round(time.perf_counter() - t0, 4),
        }

    def _match_features(self, s: Tensor, w_eff: Tensor, bias: Tensor | None, g_agg: Tensor,
                        mask: Tensor) -> tuple[Tensor, Tensor | None, float | None]:
        """Gradient matching: ``match_steps`` steps of gradient descent (with momentum
        carried across rounds) on the federated features ``s`` so that their class-mean
        gradients of the head match the clients' aggregate ``g_agg`` on the classes in
        ``mask``. Keeps the features and momentum; returns the features and the matching
        loss before (a tensor, read once) and after (None: no class to match)."""
        p, c, m = self.params, self.num_classes, self.params.features_per_class
        dim = s.shape[1]

        def loss_of(feats: Tensor) -> Tensor:
            g_fed = class_mean_grads(feats.view(c, m, dim), w_eff, bias)
            return matching_loss(g_fed, g_agg, mask, p.match_reduction, p.bias_match,
                                 has_bias=bias is not None)

        with torch.inference_mode(False), torch.enable_grad():
            first: Tensor | None = None  # read back once, after the loop (no per-step sync)
            buf = self.momentum
            for _ in range(p.match_steps if bool(mask.any()) else 0):
                leaf = s.detach().requires_grad_(True)
                loss = loss_of(leaf)
                (grad,) = torch.autograd.grad(loss, leaf)
                if first is None:
                    first = loss.detach()
                if p.feature_momentum > 0:
                    buf = grad if buf is None else p.feature_momentum * buf.to(grad) + grad
                    grad = buf
                s = (s - p.feature_lr * grad).detach()
            final = float(loss_of(s)) if first is not None else None
        self.features, self.momentum = s, buf if p.feature_momentum > 0 else None
        return s, first, final

    def after_training(self, ctx: ServerContext) -> dict[str, Any]:
        """The augmentation the client gradients ran under, their per-class cap and the
        rounds that released them, for summary.json."""
        p = self.params
        rounds = None if p.rounds is None else list(release_schedule(p.rounds, p.release_last))
        return {"creff_dsa": p.dsa, "creff_client_draws": p.client_draws,
                "creff_release_rounds": rounds}

    def eval_state(self, global_state: State) -> State:
        if self.weight is None:
            return global_state
        return write_head(global_state, self.weight, self.bias)

    def state_dict(self) -> dict[str, Any]:
        out = {"features": self.features, "momentum": self.momentum,
               "weight": self.weight, "bias": self.bias}
        return {k: v for k, v in out.items() if v is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.features = state.get("features")
        self.momentum = state.get("momentum")
        self.weight = state.get("weight")
        self.bias = state.get("bias")
