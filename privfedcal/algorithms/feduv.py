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
from privfedcal.algorithms.algorithm import Algorithm, hyper
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
