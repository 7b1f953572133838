"""Class-gradient inversion: analytic recovery from classifier gradients and iDLG labels
(the inversion of a client gradient / update is tested in test_model_updates.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from privfedcal.attacks.reconstruction.feature_inversion import InversionConfig
from privfedcal.attacks.reconstruction.gradient_inversion import (
    invert_class_gradient,
    labels_from_bias_gradient,
    recover_from_class_gradient,
    split_class_gradient,
)
from privfedcal.attacks.reconstruction.metrics import psnr
from privfedcal.errors import UsageError

MEAN, STD = [0.5], [0.25]
SHAPE = (1, 4, 4)


def _class_gradient(lin: nn.Linear, z: torch.Tensor, y: torch.Tensor):
    """Mean CE gradient of a real nn.Linear, by autograd."""
    loss = F.cross_entropy(lin(z), y)
    gw, gb = torch.autograd.grad(loss, [lin.weight, lin.bias])
    return gw, gb


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 10), st.integers(1, 16), st.integers(0, 10_000))
def test_single_sample_feature_and_label_recovered(classes, d, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d, classes)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(classes, d, generator=g))
        lin.bias.copy_(torch.randn(classes, generator=g))
    z = torch.randn(1, d, generator=g, dtype=torch.float64).float()
    y = torch.randint(classes, (1,), generator=g)
    gw, gb = _class_gradient(lin, z, y)
    z_hat, info = recover_from_class_gradient(gw, gb)
    assert F.cosine_similarity(z_hat, z[0], dim=0) > 0.999
    assert torch.allclose(z_hat, z[0], rtol=1e-3, atol=1e-4)
    assert info.label.item() == y.item() and info.negative.sum() == 1
    assert bool(info.single_sample)


def test_class_mean_gradient_gives_the_documented_weighted_mean():
    g = torch.Generator().manual_seed(0)
    n, d, classes, c = 4, 5, 3, 1
    lin = nn.Linear(d, classes)
    z = torch.randn(n, d, generator=g)
    gw, gb = _class_gradient(lin, z, torch.full((n,), c))
    # independent numpy derivation: row c = sum_i (p_ic - 1) z_i / n; weights (1 - p_ic)/sum
    p = torch.softmax(lin(z), 1).detach().double().numpy()
    zn = z.double().numpy()
    w_c = (1 - p[:, c]) / (1 - p[:, c]).sum()
    assert np.allclose((gw[c] / gb[c]).double().numpy(), w_c @ zn, atol=1e-5)
    j = 0  # another row: weights p_ij / sum_i p_ij
    assert np.allclose((gw[j] / gb[j]).double().numpy(), (p[:, j] / p[:, j].sum()) @ zn, atol=1e-5)
    # the least-squares combination equals numpy's lstsq of dW = db z^T
    z_hat, info = recover_from_class_gradient(gw, gb)
    ls = np.linalg.lstsq(gb.double().numpy()[:, None], gw.double().numpy(), rcond=None)[0][0]
    assert np.allclose(z_hat.double().numpy(), ls, atol=1e-5)
    assert info.label.item() == c and not bool(info.single_sample)
    assert info.residual.item() > 1e-3


def test_batched_creff_payload_split_and_recovered():
    g = torch.Generator().manual_seed(1)
    classes, d = 3, 4
    lin = nn.Linear(d, classes)
    z = torch.randn(classes, d, generator=g)
    blocks = []
    for c in range(classes):  # one single-sample class gradient per class
        gw, gb = _class_gradient(lin, z[c : c + 1], torch.tensor([c]))
        blocks.append(torch.cat([gw, gb[:, None]], 1))
    grad = torch.stack(blocks)  # (C, C, d+1), bias last
    z_hat, info = recover_from_class_gradient(*split_class_gradient(grad))
    assert torch.allclose(z_hat, z, atol=1e-4)
    assert info.label.tolist() == [0, 1, 2]


def test_labels_from_bias_gradient_counts():
    lin = nn.Linear(3, 4)
    nn.init.zeros_(lin.weight)
    nn.init.zeros_(lin.bias)  # p = 1/4 exactly: -B db_j = n_j - B/4
    z = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([2, 0, 0])
    _, gb = _class_gradient(lin, z, y)
    assert labels_from_bias_gradient(gb, 3).tolist() == [0, 0, 2]
    _, gb1 = _class_gradient(lin, z[:1], y[:1])
    assert labels_from_bias_gradient(gb1, 1).tolist() == [2]
    with pytest.raises(UsageError):
        labels_from_bias_gradient(gb, 0)


def test_invert_class_gradient_to_images(linear_model, images):
    x = images[:1]
    z = linear_model.features((x - MEAN[0]) / STD[0]).detach()
    gw, gb = _class_gradient(linear_model.classifier, z, torch.tensor([0]))
    res = invert_class_gradient(
        linear_model,
        gw,
        gb,
        image_shape=SHAPE,
        mean=MEAN,
        std=STD,
        generator=torch.Generator().manual_seed(2),
        config=InversionConfig(steps=200, restarts=2),
    )
    assert psnr(res.images, x).item() > 30


def test_labels_from_update_signs_only():
    gb = torch.tensor([-0.02, 0.01, -0.001, 0.011])  # update scale unknown: signs only
    assert labels_from_bias_gradient(gb, 3, use_magnitudes=False).tolist() == [0, 0, 2]
    assert labels_from_bias_gradient(gb, 1, use_magnitudes=False).tolist() == [0]
