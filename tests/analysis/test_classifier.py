"""Classifier norms and singular values against numpy."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from privfedcal.analysis import classifier_norms, classifier_weight, singular_values
from privfedcal.errors import UsageError


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.classifier = nn.Linear(3, 5)


def test_norms_hand_computed() -> None:
    # rows (3, 4) -> 5, (1, 0) -> 1, (0, 0) -> 0
    w = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    assert classifier_norms(w).tolist() == [5.0, 1.0, 0.0]
    assert classifier_norms(w).dtype == torch.float64


@settings(max_examples=25, deadline=None)
@given(c=st.integers(1, 12), d=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_norms_and_svals_match_numpy(c: int, d: int, seed: int) -> None:
    w = np.random.default_rng(seed).normal(size=(c, d)).astype(np.float32)
    np.testing.assert_allclose(
        classifier_norms(torch.from_numpy(w)).numpy(),
        np.sqrt((w.astype(np.float64) ** 2).sum(axis=1)),
        rtol=1e-12,
    )
    sv = singular_values(torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(
        sv, np.linalg.svd(w.astype(np.float64), compute_uv=False), rtol=1e-10, atol=1e-12
    )
    assert sv.shape == (min(c, d),) and np.all(np.diff(sv) <= 0)


def test_orthogonal_classifier_has_unit_singular_values() -> None:
    # FedUV's frozen baseline: orthonormal rows -> every singular value is 1
    lin = nn.Linear(16, 10)
    nn.init.orthogonal_(lin.weight, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(10, dtype=torch.float64)  # float32 weights: tolerance 1e-6
    torch.testing.assert_close(singular_values(lin), ones, rtol=0, atol=1e-6)
    torch.testing.assert_close(classifier_norms(lin), ones, rtol=0, atol=1e-6)


def test_accepts_model_with_classifier() -> None:
    model = _Tiny()
    torch.testing.assert_close(classifier_weight(model), model.classifier.weight.double())
    assert classifier_norms(model).shape == (5,)
    assert not classifier_weight(model).requires_grad


@pytest.mark.parametrize(
    "bad",
    [torch.ones(3), torch.ones(2, 2, 2), nn.Conv2d(1, 1, 1), torch.tensor([[1.0, float("nan")]])],
)
def test_rejects_bad_input(bad) -> None:
    with pytest.raises(UsageError):
        classifier_norms(bad)
