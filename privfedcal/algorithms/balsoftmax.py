"""Balanced Softmax (Ren et al., NeurIPS 2020, "Balanced Meta-Softmax for Long-Tailed Visual
Recognition"), as a federated baseline for label skew (FL-bench and PFLlib carry it).

Each client trains on its own label prior: the logits are shifted by the log of the client's
class counts before the cross-entropy,

    L = CE(z + log n_k, y),   n_k[c] = the client's training examples of class c,

so the softmax the loss sees is the client's skewed posterior while the model's own logits
``z`` estimate the balanced one; the server averages as FedAvg and predicts with ``z``. A
class the client does not hold gets log 0 = -inf (``ABSENT_LOGIT`` in practice): the loss
never pushes its logit up or down, which is what keeps local training from erasing the
classes other clients hold. The counts come from the client's own data
(``ClientContext.label_counts``) and never leave it.

Not under DP-SGD: a per-example loss that depends on the counts of the whole client dataset
changes every other example's loss when one is added or removed, so per-example clipping
would not bound the sensitivity (``dp_sgd`` stays False).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms.algorithm import Algorithm, ClientContext, State
from privfedcal.models.feature_classifier import FeatureClassifier

#: the log-prior of a class the client does not hold: exp(-1e4) is 0 in float32, so the
#: class takes no probability mass, while the arithmetic stays finite (no inf - inf)
ABSENT_LOGIT = -1e4


def log_prior(label_counts: Tensor) -> Tensor:
    """``log n_c`` per class, ``ABSENT_LOGIT`` where the count is 0 (float32)."""
    counts = label_counts.float()
    return torch.where(counts > 0, counts.clamp_min(1).log(),
                       torch.full_like(counts, ABSENT_LOGIT))


class BalancedSoftmax(Algorithm):
    """``L = CE(g(f(x)) + log n_k, y)`` with the client's class counts ``n_k``."""

    name = "balsoftmax"

    _shift: Tensor | None = None

    def begin_client(self, model: FeatureClassifier, global_state: State,
                     client_state: State | None, ctx: ClientContext | None = None) -> None:
        if ctx is None:
            raise RuntimeError("balsoftmax needs the client's label counts (ClientContext)")
        if ctx.label_counts.numel() != self.num_classes:
            raise ValueError(f"balsoftmax: {ctx.label_counts.numel()} label counts for "
                             f"{self.num_classes} classes")
        device = next(model.parameters()).device
        self._shift = log_prior(ctx.label_counts).to(device)

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        if self._shift is None:
            raise RuntimeError("balsoftmax: begin_client must be called before local_loss")
        logits = model(x)
        return F.cross_entropy(logits + self._shift.to(logits.dtype), y)

    def end_client(self, model: FeatureClassifier) -> State | None:
        self._shift = None
        return None


__all__ = ["ABSENT_LOGIT", "BalancedSoftmax", "log_prior"]
