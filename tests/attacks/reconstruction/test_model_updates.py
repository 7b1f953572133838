"""Model updates: a one-step gradient / update is inverted (Geiping et al.); the simulated
local training equals torch's SGD, labels come first from the bias change, and the
inversion reproduces a multi-step update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from privfedcal.attacks.reconstruction.feature_inversion import InversionConfig
from privfedcal.attacks.reconstruction.metrics import psnr
from privfedcal.attacks.reconstruction.model_updates import (
    LocalRecipe,
    invert_model_update,
    invert_update,
    labels_from_update,
    simulate_local_training,
)
from privfedcal.errors import UsageError

MEAN, STD = [0.5], [0.25]  # as in conftest.py
SHAPE = (1, 4, 4)


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


def _observed(model, x, y, scale=1.0):
    loss = F.cross_entropy(model((x - MEAN[0]) / STD[0]), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return {n: scale * g for (n, _), g in zip(model.named_parameters(), grads, strict=True)}


def test_invert_update_single_image_gradient_and_update(mlp_model, images):
    x, y = images[:1], torch.tensor([1])
    kw = dict(batch_size=1, image_shape=SHAPE, mean=MEAN, std=STD, steps=100, lr=0.3, tv=0.0)
    res = invert_update(
        mlp_model, _observed(mlp_model, x, y), generator=torch.Generator().manual_seed(1), **kw
    )
    assert res.labels.tolist() == [1]  # recovered from the bias gradient
    assert res.gradient_cosine > 0.999
    assert psnr(res.images, x).item() > 25
    # a one-step model update is -lr * gradient: same attack, scale-free
    upd = _observed(mlp_model, x, y, scale=-0.05)
    res_u = invert_update(
        mlp_model, upd, kind="update", generator=torch.Generator().manual_seed(1), **kw
    )
    assert psnr(res_u.images, x).item() > 25


def test_invert_update_validation(mlp_model):
    kw = dict(
        batch_size=1,
        image_shape=SHAPE,
        mean=MEAN,
        std=STD,
        generator=torch.Generator().manual_seed(0),
        steps=1,
    )
    with pytest.raises(UsageError):
        invert_update(mlp_model, {"nope": torch.zeros(1)}, **kw)
    with pytest.raises(UsageError):
        invert_update(mlp_model, {"classifier.bias": torch.zeros(3)}, kind="delta", **kw)
    with pytest.raises(UsageError):
        invert_update(
            mlp_model, {"classifier.bias": torch.zeros(3)}, labels=torch.tensor([0, 1]), **kw
        )
