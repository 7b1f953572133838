"""Classifier-weight diagnostics: per-class row norms and singular values.

- Per-class L2 norms ``||W_c||`` of the classifier rows (CCVR, Luo et al. 2021, sec. 3.2,
  fig. 3): under label skew the rows of frequent classes grow longer, which biases the
  logits toward those classes.
- Singular values of ``W`` (FedUV, Son et al. 2024, fig. 1): they shrink under non-IID
  training, while a frozen orthogonal classifier keeps them constant.

Both take a weight tensor ``(C, d)``, an ``nn.Linear`` or a model with a ``.classifier``
(``FeatureClassifier``), and compute in float64 on the weight's device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from privfedcal.errors import UsageError

__all__ = ["classifier_weight", "classifier_norms", "singular_values"]


def classifier_weight(weight: Tensor | nn.Module) -> Tensor:
    """The detached ``(C, d)`` float64 weight of a tensor, ``nn.Linear`` or ``.classifier``."""
    if isinstance(weight, nn.Module):
        module = getattr(weight, "classifier", weight)
        if not isinstance(module, nn.Linear):
            raise UsageError(
                f"expected a classifier weight, an nn.Linear or a model with a .classifier "
                f"nn.Linear; got {type(weight).__name__}"
            )
        weight = module.weight
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise UsageError(
            f"classifier weight must be a 2-D (classes x features) tensor, got {shape}"
        )
    if not torch.isfinite(weight).all():
        raise UsageError("classifier weight contains NaN or Inf")
    return weight.detach().to(torch.float64)


def classifier_norms(weight: Tensor | nn.Module) -> Tensor:
    """Per-class L2 norms ``||W_c||_2`` of the classifier rows, shape ``(C,)``, float64."""
    return torch.linalg.vector_norm(classifier_weight(weight), ord=2, dim=1)


def singular_values(weight: Tensor | nn.Module) -> Tensor:
    """Singular values of the classifier weight, descending, shape ``(min(C, d),)``, float64."""
    return torch.linalg.svdvals(classifier_weight(weight))
