"""FedUV: c, L_V and L_U against numpy; sigma without gradient; invariances; B = 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.algorithms import create_algorithm
from privfedcal.algorithms.feduv import uniformity_loss, variance_loss, variance_target
from privfedcal.errors import UsageError


def _np_variance_loss(logits: np.ndarray, c: float) -> float:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return float(np.mean(np.maximum(0.0, c - np.std(p, axis=0, ddof=1))))


def _np_uniformity_loss(z: np.ndarray) -> float:
    d2 = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)
    off = ~np.eye(len(z), dtype=bool)
    sigma = np.median(d2[off])  # over ordered pairs x != y
    return float(np.mean(np.exp(-d2[off] / (2 * sigma))))


def test_c_is_unbiased_identity_std() -> None:
    expected = np.std(np.eye(10), axis=0, ddof=1).mean()
    assert variance_target(10) == pytest.approx(expected, rel=1e-12)
    assert variance_target(10) == pytest.approx(1 / np.sqrt(10), rel=1e-12)
    assert create_algorithm("feduv", num_classes=10).c == pytest.approx(expected, rel=1e-12)


def test_variance_loss_tiny_batch() -> None:
    # 4 samples, 3 classes: column 0 varies a lot (std > c), columns 1-2 little (hinge active)
    logits = torch.tensor(
        [[4.0, 0.0, 0.1], [-3.0, 0.2, 0.0], [2.0, 0.1, 0.3], [-1.0, 0.0, 0.2]], dtype=torch.float64
    )
    c = variance_target(3)
    expected = _np_variance_loss(logits.numpy(), c)
    assert 0 < expected < c  # the hinge is active for some columns, not all
    assert variance_loss(logits, c).item() == pytest.approx(expected, rel=1e-10)


def test_uniformity_loss_tiny_batch() -> None:
    z = torch.tensor(
        [[0.0, 1.0], [1.0, 1.0], [3.0, -1.0], [0.5, 2.0], [2.0, 2.0]], dtype=torch.float64
    )
    assert uniformity_loss(z).item() == pytest.approx(_np_uniformity_loss(z.numpy()), rel=1e-10)
    # two points: sigma = their squared distance, so L_U = exp(-1/2)
    two = torch.tensor([[0.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    assert uniformity_loss(two).item() == pytest.approx(np.exp(-0.5), rel=1e-12)


def test_sigma_carries_no_gradient() -> None:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    uniformity_loss(z).backward()
    # the same energy with sigma as a plain constant
    z2 = z.detach().clone().requires_grad_(True)
    d2 = ((z2[:, None] - z2[None]) ** 2).sum(-1)
    off = ~torch.eye(6, dtype=torch.bool)
    sigma = float(np.median(d2.detach().numpy()[off.numpy()]))
    torch.exp(-d2[off] / (2 * sigma)).mean().backward()
    torch.testing.assert_close(z.grad, z2.grad)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(2, 9),
    scale=st.floats(0.1, 10.0),
    shift=st.floats(-5.0, 5.0),
)
def test_invariants(seed: int, n: int, scale: float, shift: float) -> None:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 5, generator=g, dtype=torch.float64)
    lu = uniformity_loss(z)
    # L_U is invariant to translation, scaling (sigma scales too) and row order
    torch.testing.assert_close(uniformity_loss(scale * z + shift), lu)
    torch.testing.assert_close(uniformity_loss(z[torch.randperm(n, generator=g)]), lu)
    assert 0.0 < lu.item() <= 1.0
    logits = torch.randn(n, 4, generator=g, dtype=torch.float64)
    c = variance_target(4)
    lv = variance_loss(logits, c)
    assert 0.0 <= lv.item() <= c
    assert lv.item() == pytest.approx(_np_variance_loss(logits.numpy(), c), rel=1e-9, abs=1e-12)


def test_local_loss_combines_terms(mlp, batch) -> None:
    x, y = batch
    algo = create_algorithm("feduv", num_classes=3, mu=0.7)
    assert algo.lam == 3 / 4  # default lambda = D/4
    z = mlp.features(x)
    logits = mlp.classifier(z)
    expected = (
        F.cross_entropy(logits, y)
        + 0.7 * uniformity_loss(z)
        + 0.75 * variance_loss(logits, 1 / np.sqrt(3))
    )
    torch.testing.assert_close(algo.local_loss(mlp, x, y), expected)
    assert create_algorithm("feduv", num_classes=3, lam=2.0).lam == 2.0


def test_single_sample_batch_is_plain_ce(mlp, batch) -> None:
    x, y = batch
    algo = create_algorithm("feduv", num_classes=3)
    loss = algo.local_loss(mlp, x[:1], y[:1])
    torch.testing.assert_close(loss, F.cross_entropy(mlp(x[:1]), y[:1]))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in mlp.parameters() if p.grad is not None)


def test_identical_rows_give_finite_gradients(mlp) -> None:
    x = torch.zeros(4, 1, 2, 2)
    loss = create_algorithm("feduv", num_classes=3).local_loss(mlp, x, torch.tensor([0, 1, 2, 0]))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in mlp.parameters())


@pytest.mark.parametrize("kwargs", [dict(mu=-1.0), dict(lam=-0.5), dict(lam="D/4")])
def test_bad_params(kwargs) -> None:
    with pytest.raises(UsageError):
        create_algorithm("feduv", num_classes=3, **kwargs)


def test_uniformity_accurate_under_bf16_autocast() -> None:
    # features far from the origin: a bf16 Gram matrix would lose the distances entirely
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 64, generator=g) * 5 + 20
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = uniformity_loss(z)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(_np_uniformity_loss(z.double().numpy()), rel=1e-5)
