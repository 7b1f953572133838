"""Recorded model updates: the simulated local training equals torch's SGD, labels come
first from the bias change, and the inversion reproduces a multi-step update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from privfedcal.attacks.feature_inversion import InversionConfig
from privfedcal.attacks.gradient_inversion import (
    LocalRecipe,
    invert_model_update,
    labels_from_update,
    simulate_local_training,
)
from privfedcal.errors import UsageError

MEAN, STD = [0.5], [0.25]  # as in conftest.py


def sgd_reference(model, x, y, recipe, order):
    """torch.optim.SGD on a copy of the model: what a client's local training does."""
    m = copy.deepcopy(model)
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum,
                          weight_decay=recipe.weight_decay)
    for perm in order:
        for s in range(0, x.shape[0], recipe.batch_size):
            b = perm[s:s + recipe.batch_size]
            if b.numel() < 2:
                continue
            opt.zero_grad()
            F.cross_entropy(m(x[b]), y[b]).backward()
            opt.step()
    return dict(m.named_parameters())


def test_simulation_equals_torch_sgd(toy):
    model = toy(mlp=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 1, 4, 4, generator=g)
    y = torch.randint(0, 3, (7,), generator=g)
    recipe = LocalRecipe(epochs=2, batch_size=3, lr=0.1, momentum=0.9, weight_decay=1e-2)
    order = [torch.randperm(7, generator=g) for _ in range(2)]  # last batch of 1 skipped
    start = {k: v.clone() for k, v in model.state_dict().items()}
    got = simulate_local_training(model, start, x, y, recipe, order=order)
    want = sgd_reference(model, x, y, recipe, order)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():  # the model itself is untouched
        assert torch.equal(v, start[k])


def test_labels_from_update():
    delta = torch.tensor([0.3, -0.2, 0.1, -0.2, 0.0])
    assert labels_from_update(delta, 4).tolist() == [0, 0, 0, 2]
    assert labels_from_update(delta, 1).tolist() == [0]
    assert labels_from_update(torch.tensor([-1.0, -0.5]), 2).tolist() == [1, 1]
    with pytest.raises(UsageError):
        labels_from_update(delta, 0)


@pytest.mark.slow
def test_inverting_a_two_step_update(toy, images):
    """Two local steps of SGD with momentum on two images: labels from the bias change are
    right and the reconstructed update points the same way as the recorded one."""
    model = toy(mlp=False)
    x = ((images[:2] - 0.5) / 0.25)
    with torch.no_grad():
        y = model(x).argmin(1)  # labels the model gets wrong: a clear bias signal
    recipe = LocalRecipe(epochs=2, batch_size=2, lr=0.1, momentum=0.5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    after = {k: v.detach() for k, v in
             simulate_local_training(model, start, x, y, recipe).items()}
    res = invert_model_update(model, start, after, recipe, n=2, image_shape=(1, 4, 4),
                              mean=MEAN, std=STD, generator=torch.Generator().manual_seed(0),
                              config=InversionConfig(steps=600, restarts=1, tv_weight=0.0,
                                                     l2_weight=0.0, bn_weight=0.0))
    assert sorted(res.labels.tolist()) == sorted(y.tolist())
    assert res.gradient_cosine > 0.999
    assert res.convergence is not None and res.convergence.steps <= 600
