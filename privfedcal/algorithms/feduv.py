"""FedUV (Son, Kim, Chae & Kim, CVPR 2024, Eq. 2-5): local regularisers that make a client
behave as if its data were IID::

    L = CE + mu * L_U(z) + lambda * L_V(logits)
    L_V = 1/D sum_j max(0, c - std(P[:, j])),   P = softmax(logits) over the mini-batch  (Eq. 2)
    c   = 1/D sum_j std(I_D[:, j]) = 1/sqrt(D)                                          (Eq. 3)
    L_U = mean over pairs {x, y} of exp(-||x - y||^2 / sigma)  over the rows of z          (Eq. 4)

Convention (the authors' code, sonhamin/FedUV ``algs/feduv.py``, where it is more precise
than the paper; docs/methods.md "Local methods" lists every difference):
- every std is the unbiased one (torch.std default), in c and in std_j alike, so c = 1/sqrt(D);
- L_U: the exponent is ``-d^2 / sigma`` (no factor 2), sigma = the median of the NON-ZERO
  squared pairwise distances, the lower middle value when their count is even (torch.median's
  rule), and the gradient flows through sigma as well (it is a function of z, not a constant);
  the mean runs over all unordered pairs, zero distances included (as torch.pdist's pairs);
- z = ``model.features(x)``: the output of the model's projector where the model has one.
Defaults mu = 0.5, lambda = D/4. For a batch of one both terms are undefined and skipped.
Numerical guards (ours): std_j = sqrt(max(var_j, 1e-12)) so a constant column has a finite
gradient; if every pairwise distance is zero (the authors' median would be NaN) L_U is the
constant 1 with zero gradient; distances are computed in float32 (float64 if given) outside
autocast, as squared norms of row differences (exact zeros for equal rows, smooth gradient).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms.algorithm import Algorithm, State, hyper
from privfedcal.algorithms.vector_loss import Forward, VectorLoss, weighted_ce
from privfedcal.models.feature_classifier import FeatureClassifier

_EPS = 1e-12


def variance_target(num_classes: int) -> float:
    """c of Eq. 3: mean unbiased column std of the D x D identity, = 1/sqrt(D)."""
    return 1.0 / math.sqrt(num_classes)


def variance_loss(logits: Tensor, c: float) -> Tensor:
    """L_V (Eq. 2): mean over classes of the hinge ``max(0, c - std_j)``; batch size >= 2."""
    probs = F.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=1)
    std = probs.var(dim=0, unbiased=True).clamp_min(_EPS).sqrt()
    return F.relu(c - std).mean()


def uniformity_loss(z: Tensor) -> Tensor:
    """L_U (Eq. 4, the authors' form): mean of exp(-d^2 / sigma) over unordered pairs, sigma =
    lower median of the non-zero squared distances, differentiated through sigma too."""
    # At least float32 and outside autocast: bf16 distances would swamp small ones.
    with torch.autocast(device_type=z.device.type, enabled=False):
        z = z if z.dtype == torch.float64 else z.float()
        rows, cols = torch.triu_indices(z.shape[0], z.shape[0], offset=1, device=z.device)
        diff = z[rows] - z[cols]
        pair_d2 = (diff * diff).sum(dim=1)
        nonzero = pair_d2[pair_d2 > 0]
        if nonzero.numel() == 0:
            return pair_d2.sum() * 0.0 + 1.0  # every row equal: exp(0) = 1 for every pair
        ordered = nonzero.sort().values  # sort keeps the gradient to the selected element
        sigma = ordered[(ordered.numel() - 1) // 2]
        return torch.exp(-pair_d2 / sigma).mean()


class FedUVLoss(VectorLoss):
    """FedUV: ``CE + mu * L_U(z) + lambda * L_V(logits)`` (``FedUV.local_loss``) over the real
    rows: the unbiased column variance of the softmax over them, the pairs among them, and
    sigma the lower median of their non-zero squared distances (padding rows and their
    pairs are left out of the sort with +inf). A client batch of fewer than two real rows
    has CE only, as in ``FedUV.local_loss``."""

    def loss(self, algo: Algorithm, forward: Forward, params: State, anchor: State, x: Tensor,
             y: Tensor, w: Tensor, ext: State) -> Tensor:
        z, logits = forward(params, x)
        ce = weighted_ce(logits, y, w)
        n = w.sum()
        several = (n >= 2).to(ce.dtype)  # batch statistics need two rows
        lam, c = algo.lam, algo.c  # type: ignore[attr-defined]  # FedUV's resolved weights
        return (ce + several * algo.params.mu * self.uniformity(z, w)
                + several * lam * self.variance(logits, w, n, c))

    @staticmethod
    def variance(logits: Tensor, w: Tensor, n: Tensor, c: float) -> Tensor:
        """L_V: mean over classes of ``max(0, c - std_j)``, std over the real rows."""
        probs = F.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=1)
        mean = (probs * w[:, None]).sum(0) / n
        var = (((probs - mean) ** 2) * w[:, None]).sum(0) / (n - 1).clamp_min(1)
        return F.relu(c - var.clamp_min(1e-12).sqrt()).mean()

    @staticmethod
    def uniformity(z: Tensor, w: Tensor) -> Tensor:
        """L_U: mean of exp(-d^2 / sigma) over the pairs of real rows."""
        z = z if z.dtype == torch.float64 else z.float()
        if z.shape[0] < 2:  # a batch of one row has no pair (its weight `several` is 0 too)
            return (z * 0).sum()
        rows, cols = torch.triu_indices(z.shape[0], z.shape[0], offset=1, device=z.device)
        diff = z[rows] - z[cols]
        pair_d2 = (diff * diff).sum(dim=1)
        real = w[rows] * w[cols]
        chosen = (real > 0) & (pair_d2 > 0)
        ordered = torch.where(chosen, pair_d2, torch.full_like(pair_d2, torch.inf)).sort().values
        middle = torch.div(chosen.sum() - 1, 2, rounding_mode="floor").clamp_min(0)
        sigma = ordered.gather(0, middle.reshape(1))[0]
        # no non-zero distance: sigma = inf, every term exp(0) = 1 with zero gradient (``uniformity_loss``)
        return (torch.exp(-pair_d2 / sigma) * real).sum() / real.sum().clamp_min(1)


@dataclasses.dataclass(frozen=True)
class FedUVParams:
    """mu: weight of L_U; lam: weight of L_V (None -> D/4, D = number of classes)."""

    mu: float = hyper(0.5, "weight of the uniformity loss L_U")
    lam: float | None = hyper(None, "weight of the variance loss L_V (default D/4)")

    def __post_init__(self) -> None:
        check_number("feduv", "mu", self.mu)
        if self.lam is not None:
            check_number("feduv", "lam", self.lam)


class FedUV(Algorithm):
    """FedAvg with FedUV's variance (classifier) and uniformity (representation) terms."""

    name = "feduv"
    Params = FedUVParams
    vector_loss = FedUVLoss()

    def __init__(self, params: FedUVParams | None = None, *, num_classes: int) -> None:
        super().__init__(params, num_classes=num_classes)
        self.lam = self.params.lam if self.params.lam is not None else num_classes / 4
        self.c = variance_target(num_classes)

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        z = model.features(x)
        logits = model.classifier(z)
        loss = F.cross_entropy(logits, y)
        if x.shape[0] < 2:
            return loss
        if self.params.mu:
            loss = loss + self.params.mu * uniformity_loss(z)
        if self.lam:
            loss = loss + self.lam * variance_loss(logits, self.c)
        return loss
