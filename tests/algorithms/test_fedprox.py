"""FedProx: the proximal term is 0 at the global weights and mu/2 ||w - w_g||^2 after."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from privfedcal.algorithms import create_algorithm
from privfedcal.errors import UsageError


def _flat(model) -> np.ndarray:
    return np.concatenate(
        [p.detach().double().numpy().ravel() for p in model.parameters() if p.requires_grad]
    )


def test_zero_at_global_weights(mlp, batch) -> None:
    x, y = batch
    algo = create_algorithm("fedprox", num_classes=3, mu=0.3)
    algo.begin_client(mlp, mlp.state_dict(), None)
    assert algo.proximal_term().item() == 0.0
    assert algo.local_loss(mlp, x, y).item() == F.cross_entropy(mlp(x), y).item()


def test_value_after_known_perturbation(mlp, batch, perturb) -> None:
    x, y = batch
    algo = create_algorithm("fedprox", num_classes=3, mu=0.3)
    algo.begin_client(mlp, mlp.state_dict(), None)
    # uniform shift: every one of the N weights moves by 0.5 -> 0.3/2 * N * 0.25
    n = sum(p.numel() for p in mlp.parameters())
    with torch.no_grad():
        for p in mlp.parameters():
            p.add_(0.5)
    assert algo.proximal_term().item() == pytest.approx(0.15 * n * 0.25, rel=1e-5)
    # random shift, against numpy
    before = _flat(mlp)
    perturb(mlp, seed=4)
    expected = 0.15 * np.sum((_flat(mlp) - before + 0.5) ** 2)
    assert algo.proximal_term().item() == pytest.approx(expected, rel=1e-5)
    ce = F.cross_entropy(mlp(x), y).item()
    assert algo.local_loss(mlp, x, y).item() == pytest.approx(ce + expected, rel=1e-5)


def test_gradient_is_mu_times_displacement(mlp, perturb) -> None:
    algo = create_algorithm("fedprox", num_classes=3, mu=0.2)
    start = [p.detach().clone() for p in mlp.parameters()]
    algo.begin_client(mlp, mlp.state_dict(), None)
    perturb(mlp, seed=2)
    algo.proximal_term().backward()
    for p, p0 in zip(mlp.parameters(), start, strict=True):
        torch.testing.assert_close(p.grad, 0.2 * (p.detach() - p0))


def test_frozen_parameters_are_ignored(mlp) -> None:
    mlp.classifier.requires_grad_(False)
    algo = create_algorithm("fedprox", num_classes=3)
    algo.begin_client(mlp, mlp.state_dict(), None)
    with torch.no_grad():
        mlp.classifier.weight.add_(1.0)
    assert algo.proximal_term().item() == 0.0


@pytest.mark.parametrize("mu", [-0.1, float("nan"), "big", True])
def test_bad_mu(mu) -> None:
    with pytest.raises(UsageError, match="mu"):
        create_algorithm("fedprox", num_classes=3, mu=mu)
