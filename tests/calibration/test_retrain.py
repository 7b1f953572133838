"""retrain_classifier against hand-derived SGD steps; head read/write; ReLU + Tukey."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import softmax

from privfedcal.calibration.retrain import (
    NORMALIZED_WEIGHT_KEY,
    RetrainParams,
    fresh_head,
    read_head,
    retrain_classifier,
    write_head,
)
from privfedcal.calibration.transforms import relu_tukey
from privfedcal.errors import UsageError

torch.set_num_threads(1)


def _case(seed=0, n=7, d=3, c=4):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(c, d)), rng.normal(size=c), rng.normal(size=(n, d)),
            rng.integers(0, c, size=n))


def _t(a):
    return torch.tensor(a, dtype=torch.float64)


def test_one_full_batch_step_matches_numpy_gradient():
    w, b, z, y = _case()
    lr, wd = 0.3, 0.01
    p = softmax(z @ w.T + b, axis=1)
    r = (p - np.eye(4)[y]) / len(y)           # dCE_mean/dlogits
    w_ref = w - lr * (r.T @ z + wd * w)       # torch SGD: weight decay added to the gradient
    b_ref = b - lr * (r.sum(0) + wd * b)
    w1, b1 = retrain_classifier(_t(w), _t(b), _t(z), torch.tensor(y), steps=1, lr=lr,
                                batch_size=None, momentum=0.0, weight_decay=wd,
                                generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(w1.numpy(), w_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b1.numpy(), b_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("momentum, wd, bs", [(0.0, 0.0, 32), (0.9, 1e-3, 7), (0.5, 0.0, None),
                                               (0.0, 1e-2, 9)])
def test_closed_form_head_training_equals_autograd(with_bias, momentum, wd, bs):
    w, b, z, y = _case(3, n=50)
    kw = dict(steps=23, lr=0.2, batch_size=bs, momentum=momentum, weight_decay=wd)
    bias = _t(b) if with_bias else None
    fast = retrain_classifier(_t(w), bias, _t(z), torch.tensor(y),
                              generator=torch.Generator().manual_seed(5), **kw)
    slow = retrain_classifier(_t(w), bias, _t(z), torch.tensor(y), closed_form=False,
                              generator=torch.Generator().manual_seed(5), **kw)
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-12, atol=1e-12)
    if with_bias:
        torch.testing.assert_close(fast[1], slow[1], rtol=1e-12, atol=1e-12)
    else:
        assert fast[1] is None and slow[1] is None
    assert not torch.equal(fast[0], _t(w))


@pytest.mark.parametrize("steps, bs", [(23, 9), (12, 9), (5, None)])
def test_closed_form_draws_one_permutation_per_epoch(steps, bs):
    """The permutations drawn up front are the per-epoch draws: the generator ends where
    ceil(steps / batches per epoch) randperm calls leave it (none for full batches)."""
    w, b, z, y = _case(3, n=50)
    g = torch.Generator().manual_seed(11)
    retrain_classifier(_t(w), _t(b), _t(z), torch.tensor(y), steps=steps, lr=0.1,
                       batch_size=bs, generator=g)
    ref = torch.Generator().manual_seed(11)
    for _ in range(0 if bs is None else -(-steps // -(-50 // bs))):
        torch.randperm(50, generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())


def test_autograd_path_equals_torch_sgd_loop():
    """The clsnorm (autograd) path against torch.optim.SGD on the same minibatches."""
    w, b, z, y = _case(5, n=30)
    lr, mom, wd, bs, steps = 0.3, 0.9, 1e-3, 8, 10
    got, _ = retrain_classifier(_t(w), None, _t(z), torch.tensor(y), steps=steps, lr=lr,
                                batch_size=bs, momentum=mom, weight_decay=wd,
                                generator=torch.Generator().manual_seed(2), normalized=True)
    g = torch.Generator().manual_seed(2)
    wt = _t(w).requires_grad_(True)
    opt = torch.optim.SGD([wt], lr=lr, momentum=mom, weight_decay=wd)
    zt, yt, done = _t(z), torch.tensor(y), 0
    while done < steps:
        order = torch.randperm(30, generator=g)
        for i in range(0, 30, bs):
            if done == steps:
                break
            idx = order[i:i + bs]
            u = wt / wt.norm(dim=1, keepdim=True)
            loss = torch.nn.functional.cross_entropy(zt[idx] @ u.T, yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
    torch.testing.assert_close(got, wt.detach(), rtol=0, atol=0)


def test_normalised_head_step_goes_through_the_row_normalisation():
    w, b, z, y = _case(1)
    norms = np.linalg.norm(w, axis=1, keepdims=True)
    u = w / norms
    p = softmax(z @ u.T + b, axis=1)
    g_u = ((p - np.eye(4)[y]) / len(y)).T @ z              # gradient w.r.t. the unit rows
    # d(w/|w|)/dw = (I - u u^T) / |w|, row by row
    g_w = (g_u - (g_u * u).sum(1, keepdims=True) * u) / norms
    w1, _ = retrain_classifier(_t(w), _t(b), _t(z), torch.tensor(y), steps=1, lr=0.5,
                               batch_size=None, generator=torch.Generator(), normalized=True)
    np.testing.assert_allclose(w1.numpy(), w - 0.5 * g_w, rtol=1e-10, atol=1e-12)


def test_minibatches_are_deterministic_per_generator_and_reduce_the_loss():
    w, b, z, y = _case(2, n=40)
    args = dict(steps=30, lr=0.2, batch_size=8, momentum=0.9)
    runs = [retrain_classifier(_t(w), _t(b), _t(z), torch.tensor(y), **args,
                               generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])

    def loss(wt, bt):
        return torch.nn.functional.cross_entropy(_t(z) @ wt.T + bt, torch.tensor(y))

    assert loss(*runs[0]) < loss(_t(w), _t(b)) - 0.1


def test_bias_free_head_and_zero_steps():
    w, _, z, y = _case(3)
    w1, b1 = retrain_classifier(_t(w), None, _t(z), torch.tensor(y), steps=3, lr=0.1,
                                batch_size=4, generator=torch.Generator())
    assert b1 is None and not torch.equal(w1, _t(w))
    w0, _ = retrain_classifier(_t(w), None, _t(z), torch.tensor(y), steps=0, lr=0.1,
                               batch_size=4, generator=torch.Generator())
    assert torch.equal(w0, _t(w))


def test_works_under_inference_mode():
    w, b, z, y = _case(4)
    with torch.inference_mode():
        zt = _t(z)
    w1, _ = retrain_classifier(_t(w), _t(b), zt, torch.tensor(y), steps=2, lr=0.1,
                               batch_size=None, generator=torch.Generator())
    assert torch.isfinite(w1).all()


def test_head_read_write_keeps_the_key():
    plain = {"classifier.weight": torch.zeros(2, 3), "classifier.bias": torch.zeros(2),
             "extractor.weight": torch.ones(3, 3)}
    normed = {NORMALIZED_WEIGHT_KEY: torch.zeros(2, 3), "classifier.bias": torch.zeros(2)}
    assert not read_head(plain).normalized and read_head(normed).normalized
    new_w = torch.ones(2, 3, dtype=torch.float64)
    out = write_head(normed, new_w, torch.full((2,), 2.0))
    assert set(out) == set(normed) and out[NORMALIZED_WEIGHT_KEY].dtype == torch.float32
    assert torch.equal(out[NORMALIZED_WEIGHT_KEY], torch.ones(2, 3))
    assert torch.equal(out["classifier.bias"], torch.full((2,), 2.0))
    assert torch.equal(normed[NORMALIZED_WEIGHT_KEY], torch.zeros(2, 3))  # input untouched
    out = write_head(plain, new_w, None)
    assert torch.equal(out["extractor.weight"], plain["extractor.weight"])
    assert torch.equal(out["classifier.bias"], torch.zeros(2))


def test_fresh_head_is_nn_linear_range_and_seeded():
    w, b = fresh_head(5, 16, torch.Generator().manual_seed(0))
    w2, _ = fresh_head(5, 16, torch.Generator().manual_seed(0))
    assert torch.equal(w, w2) and w.abs().max() <= 0.25 and b.abs().max() <= 0.25
    assert w.abs().max() > 0.2   # spans the range, not a constant


def test_retrain_params_validation_and_step_count():
    assert RetrainParams(epochs=3, batch_size=10, min_steps=0).num_steps(25) == 9
    assert RetrainParams(epochs=3, batch_size=10).num_steps(25) == 100
    assert RetrainParams(epochs=3, batch_size=10).num_steps(400) == 120
    assert RetrainParams(steps=7).num_steps(1000) == 7
    for bad in (dict(lr=0), dict(batch_size=0), dict(momentum=1.0), dict(steps=-1)):
        with pytest.raises(UsageError):
            RetrainParams(**bad)


def test_relu_tukey_values():
    z = torch.tensor([-1.0, 0.0, 0.25, 4.0])
    assert torch.equal(relu_tukey(z), torch.tensor([0.0, 0.0, 0.5, 2.0]))
    np.testing.assert_allclose(relu_tukey(z, 0.0).numpy(),
                               np.log(np.array([0, 0, 0.25, 4.0]) + 1e-6), rtol=1e-6)
    assert torch.equal(relu_tukey(z, 1.0), torch.relu(z))
    with pytest.raises(UsageError):
        relu_tukey(z, -0.5)
