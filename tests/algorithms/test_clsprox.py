"""clsprox: a proximal term on the classifier (weight and bias) only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from privfedcal.algorithms import create_algorithm
from privfedcal.errors import UsageError


def test_zero_at_global_then_classifier_only(mlp, batch, perturb) -> None:
    x, y = batch
    algo = create_algorithm("clsprox", num_classes=3, mu=0.4)
    algo.begin_client(mlp, mlp.state_dict(), None)
    assert algo.proximal_term().item() == 0.0
    w0 = mlp.classifier.weight.detach().double().numpy().copy()
    b0 = mlp.classifier.bias.detach().double().numpy().copy()
    perturb(mlp, seed=5)  # moves every layer, extractor included
    w = mlp.classifier.weight.detach().double().numpy()
    b = mlp.classifier.bias.detach().double().numpy()
    expected = 0.2 * (np.sum((w - w0) ** 2) + np.sum((b - b0) ** 2))
    assert algo.proximal_term().item() == pytest.approx(expected, rel=1e-5)
    ce = F.cross_entropy(mlp(x), y).item()
    assert algo.local_loss(mlp, x, y).item() == pytest.approx(ce + expected, rel=1e-5)


def test_gradient_touches_only_the_classifier(mlp, perturb) -> None:
    algo = create_algorithm("clsprox", num_classes=3, mu=0.4)
    w0 = mlp.classifier.weight.detach().clone()
    algo.begin_client(mlp, mlp.state_dict(), None)
    perturb(mlp, seed=6)
    algo.proximal_term().backward()
    for p in mlp.extractor_parameters():
        assert p.grad is None
    torch.testing.assert_close(
        mlp.classifier.weight.grad, 0.4 * (mlp.classifier.weight.detach() - w0)
    )
    assert mlp.classifier.bias.grad.abs().sum() > 0


def test_bad_mu() -> None:
    with pytest.raises(UsageError, match="mu"):
        create_algorithm("clsprox", num_classes=3, mu=float("inf"))
