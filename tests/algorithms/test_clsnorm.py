"""clsnorm: logits z . W_i / ||W_i||, no bias, invariant to the scale of each row."""

from __future__ import annotations

import numpy as np
import torch

from privfedcal.algorithms import create_algorithm

KEY = "classifier.parametrizations.weight.original"


def _configured(make_mlp, seed: int = 0):
    model = make_mlp(seed)
    create_algorithm("clsnorm", num_classes=3).configure_model(
        model, torch.Generator().manual_seed(0)
    )
    return model


def test_logits_are_normalised_dot_products(make_mlp, batch) -> None:
    x, _ = batch
    model = _configured(make_mlp)
    with torch.no_grad():
        z = model.features(x).double().numpy()
        logits = model(x).double().numpy()
    w = model.state_dict()[KEY].double().numpy()
    expected = z @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(model.classifier.bias) == 0
    assert not model.classifier.bias.requires_grad


def test_invariant_to_row_scale(make_mlp, batch) -> None:
    x, _ = batch
    model = _configured(make_mlp)
    with torch.no_grad():
        before = model(x)
        model.classifier.parametrizations.weight.original[1].mul_(3.7)
        after = model(x)
    torch.testing.assert_close(after, before)


def test_training_keeps_bias_zero_and_states_portable(make_mlp, make_batch) -> None:
    model, other = _configured(make_mlp, 0), _configured(make_mlp, 5)
    algo = create_algorithm("clsnorm", num_classes=3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    w0 = model.state_dict()[KEY].clone()
    for step in range(3):
        x, y = make_batch(8, seed=step)
        opt.zero_grad()
        algo.local_loss(model, x, y).backward()
        opt.step()
    assert torch.count_nonzero(model.classifier.bias) == 0
    assert not torch.equal(model.state_dict()[KEY], w0)
    other.load_state_dict(model.state_dict())  # same keys on every configured model
    x, _ = make_batch(4, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x))
