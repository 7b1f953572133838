"""Freeze: an orthogonal, zero-bias classifier that no optimiser step changes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from privfedcal.algorithms import create_algorithm


def _configured(make_mlp, seed: int):
    model = make_mlp(seed)
    create_algorithm("freeze", num_classes=3).configure_model(
        model, torch.Generator().manual_seed(seed)
    )
    return model


def test_rows_orthonormal_bias_zero_frozen(make_mlp) -> None:
    model = _configured(make_mlp, 0)
    w = model.classifier.weight.detach().double()
    torch.testing.assert_close(w @ w.T, torch.eye(3, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.count_nonzero(model.classifier.bias) == 0
    assert not any(p.requires_grad for p in model.classifier.parameters())
    assert all(p.requires_grad for p in model.extractor_parameters())


def test_head_never_changes_during_training(make_mlp, make_batch) -> None:
    model = _configured(make_mlp, 0)
    algo = create_algorithm("freeze", num_classes=3)
    head = {k: v.clone() for k, v in model.classifier.state_dict().items()}
    body = [p.detach().clone() for p in model.extractor_parameters()]
    opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9, weight_decay=1e-3
    )
    algo.begin_client(model, model.state_dict(), None)
    for step in range(4):
        x, y = make_batch(8, seed=step)
        opt.zero_grad()
        loss = algo.local_loss(model, x, y)
        torch.testing.assert_close(loss, F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()
    for key, value in model.classifier.state_dict().items():
        assert torch.equal(value, head[key])
    assert any(
        not torch.equal(p, b) for p, b in zip(model.extractor_parameters(), body, strict=True)
    )


def test_same_seed_same_head_everywhere(make_mlp) -> None:
    # workers build their model with other weights but configure it with the same seed
    a, b = _configured(make_mlp, 0), make_mlp(7)
    create_algorithm("freeze", num_classes=3).configure_model(b, torch.Generator().manual_seed(0))
    assert torch.equal(a.classifier.weight, b.classifier.weight)
    c = _configured(make_mlp, 1)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_classifier_is_kept_out_of_averaging() -> None:
    assert create_algorithm("freeze", num_classes=3).frozen_prefixes == ("classifier.",)
