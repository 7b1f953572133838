"""Balanced Softmax: cross-entropy of the logits shifted by the client's log class counts,
against numpy; absent classes take no probability and get no gradient; a whole run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privfedcal.algorithms import ClientContext, create_algorithm
from privfedcal.algorithms.balsoftmax import ABSENT_LOGIT


def _numpy_loss(logits: np.ndarray, y: np.ndarray, counts: np.ndarray) -> float:
    shifted = logits + np.where(counts > 0, np.log(np.maximum(counts, 1)), ABSENT_LOGIT)
    m = shifted.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(shifted - m).sum(axis=1, keepdims=True)))[:, 0]
    return float(np.mean(lse - shifted[np.arange(len(y)), y]))


def test_loss_is_cross_entropy_of_logits_plus_log_prior(mlp, batch) -> None:
    x, y = batch
    counts = torch.tensor([40, 7, 1])
    algo = create_algorithm("balsoftmax", num_classes=3)
    algo.begin_client(mlp, mlp.state_dict(), None, ClientContext(0, counts))
    logits = mlp(x).detach().double().numpy()
    want = _numpy_loss(logits, y.numpy(), counts.numpy())
    assert algo.local_loss(mlp, x, y).item() == pytest.approx(want, abs=1e-5)
    # the prior matters: uniform counts give plain cross-entropy, skewed ones do not
    plain = create_algorithm("fedavg", num_classes=3).local_loss(mlp, x, y).item()
    assert abs(algo.local_loss(mlp, x, y).item() - plain) > 1e-3
    algo.begin_client(mlp, mlp.state_dict(), None, ClientContext(0, torch.tensor([5, 5, 5])))
    assert algo.local_loss(mlp, x, y).item() == pytest.approx(plain, abs=1e-5)


def test_an_absent_class_gets_no_probability_and_no_gradient(mlp, batch) -> None:
    x, y = batch
    held = y != 2
    x, y = x[held], y[held]
    algo = create_algorithm("balsoftmax", num_classes=3)
    algo.begin_client(mlp, mlp.state_dict(), None, ClientContext(0, torch.tensor([10, 4, 0])))
    loss = algo.local_loss(mlp, x, y)
    assert torch.isfinite(loss)
    loss.backward()
    # the classifier row of the absent class receives no gradient
    weight = mlp.classifier.weight
    assert torch.count_nonzero(weight.grad[2]) == 0 and torch.count_nonzero(weight.grad[:2]) > 0


def test_needs_the_client_context(mlp, batch) -> None:
    algo = create_algorithm("balsoftmax", num_classes=3)
    with pytest.raises(RuntimeError, match="label counts"):
        algo.begin_client(mlp, mlp.state_dict(), None)
    with pytest.raises(ValueError, match="4 label counts for 3 classes"):
        algo.begin_client(mlp, mlp.state_dict(), None, ClientContext(0, torch.ones(4)))


def test_a_run_trains_and_is_refused_under_dp_sgd(tiny_cfg, tmp_path) -> None:
    from privfedcal.errors import UsageError
    from privfedcal.experiment import build_simulator

    summary = build_simulator(tiny_cfg(method="balsoftmax"), tmp_path / "a").run()
    assert 0.0 < summary["accuracy"] <= 1.0
    with pytest.raises(UsageError, match="--dp-train supports"):
        build_simulator(tiny_cfg(method="balsoftmax", dp_eps=8.0, dp_train=True),
                        tmp_path / "b")
