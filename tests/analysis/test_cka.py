"""Linear CKA against the HSIC form with a centering matrix, computed in numpy."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import ortho_group
from torch import nn

from privfedcal.analysis import cka_matrix, layer_features, linear_cka, pairwise_cka
from privfedcal.errors import UsageError


def hsic_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al. eq. via HSIC: tr(K H L H) / sqrt(tr(K H K H) tr(L H L H)), K = X X^T."""
    n = x.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = x @ x.T, y @ y.T

    def hsic(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.trace(a @ h @ b @ h))

    return hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_))


# (n, p, q): the first takes the Gram path (n < 2 max width), the others the feature path
@pytest.mark.parametrize("n,p,q", [(6, 40, 30), (50, 3, 7), (200, 5, 5)])
def test_matches_numpy_hsic(n: int, p: int, q: int) -> None:
    rng = np.random.default_rng(n + p + q)
    x = rng.normal(size=(n, p)) + 3.0  # offset: centring must matter
    y = x[:, :1] * rng.normal(size=(1, q)) + 0.5 * rng.normal(size=(n, q))
    expected = hsic_cka(x, y)
    assert 0.05 < expected < 0.99  # a non-trivial value
    assert linear_cka(torch.from_numpy(x), torch.from_numpy(y)) == pytest.approx(
        expected, rel=1e-10
    )
    assert linear_cka(torch.from_numpy(x).float(), torch.from_numpy(y).float()) == pytest.approx(
        expected, rel=1e-5
    )


def test_hand_computed_value() -> None:
    # columns already centred: X^T Y = [4, 2] -> ||.||_F^2 = 20; X^T X = [[2]] -> 2;
    # Y^T Y = [[8, 4], [4, 2]] -> sqrt(64 + 16 + 16 + 4) = 10; CKA = 20 / (2 * 10) = 1
    x = torch.tensor([[1.0], [-1.0]])
    y = torch.tensor([[2.0, 1.0], [-2.0, -1.0]])
    assert linear_cka(x, y) == pytest.approx(1.0)
    # X = (1, 0, -1), Y = (1, -1, 0): X^T Y = 1, X^T X = Y^T Y = 2 -> 1 / (2 * 2) = 0.25
    assert linear_cka(
        torch.tensor([[1.0], [0.0], [-1.0]]), torch.tensor([[1.0], [-1.0], [0.0]])
    ) == pytest.approx(0.25)
    # X = (1, -1, 1, -1), Y = (1, 1, -1, -1): X^T Y = 0 -> CKA = 0
    x = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    y = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]])
    assert linear_cka(x, y) == pytest.approx(0.0, abs=1e-15)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 30),
    p=st.integers(1, 8),
    q=st.integers(1, 8),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
def test_invariances(n: int, p: int, q: int, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, p)), rng.normal(size=(n, q))
    base = linear_cka(torch.from_numpy(x), torch.from_numpy(y))
    assert linear_cka(torch.from_numpy(x), torch.from_numpy(x)) == pytest.approx(1.0, rel=1e-12)
    assert 0.0 <= base <= 1.0 + 1e-12
    q_rot = ortho_group.rvs(p, random_state=seed) if p > 1 else np.array([[-1.0]])
    transformed = torch.from_numpy(scale * x @ q_rot + 7.0)  # rotate, scale, shift
    assert linear_cka(transformed, torch.from_numpy(y)) == pytest.approx(base, rel=1e-8, abs=1e-12)
    assert linear_cka(torch.from_numpy(y), torch.from_numpy(x)) == pytest.approx(
        base, rel=1e-10, abs=1e-14
    )
    assert base == pytest.approx(hsic_cka(x, y), rel=1e-8, abs=1e-12)


def test_constant_features_are_undefined_and_bad_inputs_refused() -> None:
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    assert np.isnan(linear_cka(torch.ones(5, 3), x))
    with pytest.raises(UsageError):
        linear_cka(x, x[:4])
    with pytest.raises(UsageError):
        linear_cka(x[:1], x[:1])
    with pytest.raises(UsageError):
        linear_cka(x, torch.full((5, 2), float("inf")))


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # test-only construction; the analysis itself draws nothing
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3)
    )


def test_layer_features_flatten_batch_and_restore_mode() -> None:
    net, x = _net(0), torch.randn(7, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    net.train()
    feats = layer_features(net, x, ["0", "3", "5"], batch_size=3)
    assert net.training and not any(m._forward_hooks for m in net.modules())
    assert {k: tuple(v.shape) for k, v in feats.items()} == {"0": (7, 8), "3": (7, 4), "5": (7, 3)}
    with torch.no_grad():
        conv = net[0](x)
        torch.testing.assert_close(feats["0"], conv.reshape(7, -1))
        torch.testing.assert_close(feats["5"], net(x))


def test_layer_features_refuses_unknown_and_reused_modules() -> None:
    with pytest.raises(UsageError, match="valid layers: 0, 1"):
        layer_features(_net(0), torch.zeros(2, 1, 4, 4), ["nope"])
    relu = nn.ReLU()
    shared = nn.Sequential(nn.Linear(3, 3), relu, nn.Linear(3, 3), relu)
    with pytest.raises(UsageError, match="ran 2 times"):
        layer_features(shared, torch.zeros(2, 3), ["1"])
    assert not relu._forward_hooks


def test_cka_matrix_models_and_feature_sets_agree() -> None:
    x = torch.randn(20, 1, 4, 4, generator=torch.Generator().manual_seed(2))
    models = [_net(0), _net(1), _net(0)]  # clients 0 and 2 identical
    res = cka_matrix(models, x, ["0", "5"])
    assert res.layers == ("0", "5")
    for layer in res.layers:
        mat = res.matrices[layer]
        assert mat.shape == (3, 3)
        torch.testing.assert_close(mat, mat.T)
        torch.testing.assert_close(mat.diagonal(), torch.ones(3, dtype=torch.float64))
        assert mat[0, 2].item() == pytest.approx(1.0)
        feats = [layer_features(m, x, [layer])[layer] for m in models]
        pairs = [linear_cka(feats[i], feats[j]) for i, j in [(0, 1), (0, 2), (1, 2)]]
        assert res.mean[layer] == pytest.approx(np.mean(pairs), rel=1e-10)
        assert mat[0, 1].item() == pytest.approx(
            hsic_cka(feats[0].double().numpy(), feats[1].double().numpy()), rel=1e-8
        )
    sets = [layer_features(m, x, ["0", "5"]) for m in models]
    res2 = cka_matrix(sets)
    assert res2.mean == pytest.approx(res.mean)


def test_pairwise_paths_agree() -> None:
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(12, 5, generator=g) for _ in range(4)]  # feature path (12 >= 10)
    wide = [torch.cat([f, torch.zeros(12, 20)], dim=1) for f in feats]  # zero columns -> Gram path
    torch.testing.assert_close(pairwise_cka(feats), pairwise_cka(wide), rtol=1e-10, atol=1e-12)


def test_cka_matrix_usage_errors() -> None:
    with pytest.raises(UsageError):
        cka_matrix([_net(0)], torch.zeros(2, 1, 4, 4), ["0"])
    with pytest.raises(UsageError):
        cka_matrix([_net(0), _net(1)])
    with pytest.raises(UsageError, match="missing"):
        cka_matrix([{"a": torch.randn(3, 2)}, {"b": torch.randn(3, 2)}])
