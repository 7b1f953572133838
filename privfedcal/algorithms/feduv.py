"""FedUV (Son, Kim, Chae & Kim, CVPR 2024, Eq. 2-5): local regularisers that make a client
behave as if its data were IID::

    L = CE + mu * L_U(z) + lambda * L_V(logits)
    L_V = 1/D sum_j max(0, c - std(P[:, j])),   P = softmax(logits) over the mini-batch  (Eq. 2)
    c   = 1/D sum_j std(I_D[:, j]) = 1/sqrt(D)                                          (Eq. 3)
    L_U = E_{x != y} exp(-||x - y||^2 / (2 sigma))  over the rows of z                  (Eq. 4)

Convention (the paper's equations; docs/methods.md "Local methods" says where the authors'
code differs):
- every std is the unbiased one (torch.std default), in c and in std_j alike, so c = 1/sqrt(D);
- sigma = median of the squared distances over pairs x != y, without gradient;
- L_U is the mean over pairs x != y; z = ``model.features(x)`` (the penultimate output).
Defaults mu = 0.5, lambda = D/4. For a batch of one both terms are undefined and skipped.
Numerical guards (ours): std_j = sqrt(max(var_j, 1e-12)) so a constant column has a finite
gradient; sigma is at least 1e-12; distances are computed in float32 (float64 if given)
outside autocast, from batch-centred features.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms.base import Algorithm, register
from privfedcal.models.base import FeatureClassifier

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
    """L_U (Eq. 4): mean Gaussian energy over pairs x != y, sigma = median squared distance."""
    # At least float32 and outside autocast: a bf16 Gram matrix would swamp small distances.
    # Centring changes no distance and reduces cancellation in |x|^2 + |y|^2 - 2 x.y.
    with torch.autocast(device_type=z.device.type, enabled=False):
        z = z if z.dtype == torch.float64 else z.float()
        z = z - z.mean(dim=0, keepdim=True)
        sq = (z * z).sum(dim=1)
        d2 = (sq[:, None] + sq[None, :] - 2.0 * (z @ z.T)).clamp_min(0.0)
    rows, cols = torch.triu_indices(z.shape[0], z.shape[0], offset=1, device=z.device)
    pair_d2 = d2[rows, cols]  # each unordered pair once: same mean and median as ordered pairs
    ordered = pair_d2.detach().sort().values
    n = ordered.numel()
    sigma = (0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])).clamp_min(_EPS)
    return torch.exp(-pair_d2 / (2.0 * sigma)).mean()


@dataclasses.dataclass(frozen=True)
class FedUVParams:
    """mu: weight of L_U; lam: weight of L_V (None -> D/4, D = number of classes)."""

    mu: float = 0.5
    lam: float | None = None

    def __post_init__(self) -> None:
        check_number("feduv", "mu", self.mu)
        if self.lam is not None:
            check_number("feduv", "lam", self.lam)


@register
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
