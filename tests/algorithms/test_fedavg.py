"""FedAvg: plain cross-entropy, the average is the new global model."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from privfedcal.algorithms import create_algorithm


def test_local_loss_is_cross_entropy(mlp, batch) -> None:
    x, y = batch
    algo = create_algorithm("fedavg", num_classes=3)
    algo.begin_client(mlp, mlp.state_dict(), None)
    logits = mlp(x).detach().double().numpy()
    # numpy cross-entropy: mean of logsumexp(logits) - logits[y]
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    expected = float(np.mean(lse - logits[np.arange(len(y)), y.numpy()]))
    assert abs(algo.local_loss(mlp, x, y).item() - expected) < 1e-5
    torch.testing.assert_close(algo.local_loss(mlp, x, y), F.cross_entropy(mlp(x), y))
    assert algo.end_client(mlp) is None


def test_server_returns_average(mlp) -> None:
    algo = create_algorithm("fedavg", num_classes=3)
    avg = {k: v + 1 for k, v in mlp.state_dict().items()}
    new, state = algo.server_update(mlp.state_dict(), avg, None)
    assert new is avg and state is None
