"""FedUV: c, L_V and L_U against numpy; L_U's gradient (through sigma too) against an
independent torch expression of the authors' formula and finite differences; invariances; B = 1."""

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
    """The authors' L_U: unordered pairs, sigma = lower median of the non-zero squared
    distances, mean of exp(-d^2 / sigma) over every pair."""
    i, j = np.triu_indices(len(z), k=1)
    d2 = ((z[i] - z[j]) ** 2).sum(-1)
    nonzero = np.sort(d2[d2 > 0])
    sigma = nonzero[(len(nonzero) - 1) // 2]
    return float(np.mean(np.exp(-d2 / sigma)))


def _torch_authors_uniformity(z: torch.Tensor, detach_sigma: bool = False) -> torch.Tensor:
    """An independent torch expression of the same formula (pdist + torch.median)."""
    d2 = torch.pdist(z, p=2).pow(2)
    sigma = torch.median(d2[d2 != 0])
    return torch.exp(-d2 / (sigma.detach() if detach_sigma else sigma)).mean()


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
    # 10 pairs: an even count, so the lower of the two middle distances is sigma
    assert uniformity_loss(z).item() == pytest.approx(_np_uniformity_loss(z.numpy()), rel=1e-10)
    # two points: sigma = their squared distance, so L_U = exp(-1)
    two = torch.tensor([[0.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    assert uniformity_loss(two).item() == pytest.approx(np.exp(-1.0), rel=1e-12)
    # hand-worked: points 0, 1, 3 on a line: d2 = 1, 9, 4; sigma = 4; mean(e^-1/4, e^-9/4, e^-1)
    line = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64)
    expected = np.mean(np.exp(-np.array([1.0, 9.0, 4.0]) / 4.0))
    assert uniformity_loss(line).item() == pytest.approx(expected, rel=1e-12)


def test_sigma_ignores_zero_distances() -> None:
    # duplicated rows: zero distances count in the mean but not in the median
    z = torch.tensor([[0.0], [0.0], [0.0], [1.0], [3.0]], dtype=torch.float64)
    # d2: three zeros, 1 x3, 9 x3, 4 -> non-zero 1,1,1,4,9,9,9: median 4 (with zeros it would be 1)
    got = uniformity_loss(z).item()
    assert got == pytest.approx(_np_uniformity_loss(z.numpy()), rel=1e-12)
    d2 = np.array([0, 0, 0, 1, 1, 1, 9, 9, 9, 4.0])
    assert got == pytest.approx(np.mean(np.exp(-d2 / 4.0)), rel=1e-12)
    every_equal = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    loss = uniformity_loss(every_equal)
    loss.backward()
    assert loss.item() == 1.0 and torch.count_nonzero(every_equal.grad) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_flows_through_sigma(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    uniformity_loss(z).backward()
    ours = z.grad.clone()
    # against the independent torch expression of the authors' formula ...
    ref = z.detach().clone().requires_grad_(True)
    _torch_authors_uniformity(ref).backward()
    torch.testing.assert_close(ours, ref.grad, rtol=1e-10, atol=1e-12)
    # ... and against central finite differences (no autograd involved)
    torch.autograd.gradcheck(uniformity_loss, (z.detach().clone().requires_grad_(True),))
    # the part through sigma is not negligible: detaching it changes the gradient
    det = z.detach().clone().requires_grad_(True)
    _torch_authors_uniformity(det, detach_sigma=True).backward()
    assert (ours - det.grad).norm() > 0.05 * ours.norm()


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
