"""CReFF class gradients combined across rounds: the recorded head, rank-n recovery from
several releases of the same features, and image inversion through several rounds' models."""

from __future__ import annotations

import itertools

import pytest
import torch

from privfedcal.attacks.reconstruction.gradient_inversion import (
    _head_gradient,
    recover_rank_n,
    recover_rank_n_rounds,
)
from privfedcal.attacks.reconstruction.rounds import invert_class_gradients
from privfedcal.calibration.creff import per_sample_head_grads
from privfedcal.errors import UsageError

MEAN, STD = [0.5], [0.25]  # as conftest.py


def _perm_error(z_hat: torch.Tensor, z: torch.Tensor) -> float:
    """Relative error of the best matching of recovered rows to true rows."""
    return min(float((z_hat[list(p)] - z).norm() / z.norm())
               for p in itertools.permutations(range(z.shape[0])))


def test_head_gradient_is_creffs_client_upload():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 6, generator=g, dtype=torch.float64)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    y = torch.full((4,), 2, dtype=torch.long)
    assert torch.allclose(_head_gradient(z, w, b, 2), per_sample_head_grads(z, y, w, b).mean(0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_rounds_pin_three_features_one_round_leaves_open(seed):
    """C = 3 classes: one release has rank <= C - 1 = 2 < n = 3, and a different feature set
    reproduces it exactly (residual ~0, features wrong); two releases under different heads
    give rank 3 and the features exactly (up to order)."""
    g = torch.Generator().manual_seed(seed)
    c, d, n, label = 3, 5, 3, 1
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    heads = [(torch.randn(c, d, generator=g, dtype=torch.float64),
              torch.randn(c, generator=g, dtype=torch.float64)) for _ in range(2)]
    grads = [_head_gradient(z, w, b, label) for w, b in heads]
    one = recover_rank_n_rounds(grads[:1], heads[:1], label, n,
                                generator=torch.Generator().manual_seed(0))
    two = recover_rank_n_rounds(grads, heads, label, n,
                                generator=torch.Generator().manual_seed(0))
    assert one.rank == 2 and two.rank == 3
    assert two.residual < 1e-6 and _perm_error(two.features, z) < 1e-5
    assert _perm_error(one.features, z) > 1e-2  # fits its release, misses the features
    assert _perm_error(one.features, z) > 1e3 * _perm_error(two.features, z)


def test_one_round_equals_recover_rank_n():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 4, generator=g, dtype=torch.float64)
    w, b = torch.randn(4, 4, generator=g, dtype=torch.float64), None
    grad = _head_gradient(z, w, b, 0)
    a = recover_rank_n(grad, w, b, 0, 2, generator=torch.Generator().manual_seed(1))
    r = recover_rank_n_rounds([grad], [(w, b)], 0, 2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.features, r.features) and a.residual == r.residual
    assert _perm_error(a.features, z) < 1e-5
    with pytest.raises(UsageError, match="one head per class gradient"):
        recover_rank_n_rounds([grad, grad], [(w, b)], 0, 2, generator=torch.Generator())


def test_invert_class_gradients_uses_each_rounds_state_and_head(toy, images):
    """Two rounds with different extractors and heads: the true image reproduces both
    uploads (cosine 1 under the objective), the inversion gets close to it, and the model's
    own tensors are left as they were."""
    m1, m2 = toy(d=24, seed=1), toy(d=24, seed=2)
    x = images[:1]
    label = 1
    states, heads, grads = [], [], []
    for m in (m1, m2):
        with torch.no_grad():
            z = m.features((x - MEAN[0]) / STD[0]).double()
        w, b = m.classifier.weight.double(), m.classifier.bias.double()
        states.append({k: v.clone() for k, v in m.state_dict().items()})
        heads.append((w, b))
        grads.append(_head_gradient(z, w, b, label))
    model = toy(d=24, seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = invert_class_gradients(model, states, heads, grads, label, 1, image_shape=(1, 4, 4),
                                 mean=MEAN, std=STD, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert res.gradient_cosine > 0.999
    assert res.labels.tolist() == [label]
    assert float((res.images - x).abs().max()) < 0.05
    with pytest.raises(UsageError, match="one model state, head and class gradient"):
        invert_class_gradients(model, states, heads[:1], grads, label, 1, image_shape=(1, 4, 4),
                               mean=MEAN, std=STD, generator=torch.Generator())


def test_sent_tensors_add_the_tasks_public_tensors_under_a_prefix():
    from privfedcal.calibration.creff import GradTask
    from privfedcal.privacy.transcript import TASK_PREFIX, sent_tensors

    state = {"classifier.weight": torch.zeros(3, 4)}
    assert sent_tensors(state, object()) is state  # a task without public tensors
    w, b = torch.randn(3, 4), torch.randn(3)
    sent = sent_tensors(state, GradTask(w, b, 3))
    assert set(sent) == {"classifier.weight", TASK_PREFIX + "head.weight",
                         TASK_PREFIX + "head.bias"}
    assert sent[TASK_PREFIX + "head.weight"] is w and sent[TASK_PREFIX + "head.bias"] is b
    assert set(sent_tensors(state, GradTask(w, None, 3))) == {"classifier.weight",
                                                             TASK_PREFIX + "head.weight"}
