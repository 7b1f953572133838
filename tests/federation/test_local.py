"""federation/local.py: seeds, evaluation, the training layout (PlainSGD: test_plain_sgd.py;
the running average: test_aggregate.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from privfedcal.federation.local import evaluate
from privfedcal.seeding import derive_seed, make_generator


def test_derive_seed_is_numpy_seedsequence_halved():
    ref = int(np.random.SeedSequence([0, 1, 2, 3]).generate_state(2, dtype=np.uint64)[0]) >> 1
    assert derive_seed(0, 1, 2, 3) == ref == 6463705122041852897
    assert 0 <= derive_seed(7) < 2**63
    # parts are taken modulo 2^32
    assert derive_seed(2**32 + 5) == derive_seed(5)
    g1, g2 = make_generator(0, 1, 2, 3), make_generator(0, 1, 2, 3)
    assert g1.initial_seed() == ref
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


class _Linear(nn.Module):
    """features = identity, classifier = a fixed 2x2 linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(2, 2, bias=False)

    def features(self, x):
        return x


def test_evaluate_accuracy_per_class_and_loss_by_hand():
    model = _Linear()
    state = {"classifier.weight": torch.eye(2)}
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [3.0, 0.0]])
    y = torch.tensor([0, 1, 1, 0])
    # logits = x; predictions 0, 1, 0, 0: class 0 both right, class 1 one of two
    out = evaluate(model, state, x, y, num_classes=3, batch_size=3)
    assert out["accuracy"] == 0.75
    assert out["per_class_accuracy"] == [1.0, 0.5, None]  # class 2 absent from the test set
    ce = [math.log1p(math.exp(-d)) for d in (2.0, 1.0, -1.0, 3.0)]  # CE of 2 logits, margin d
    assert out["loss"] == pytest.approx(sum(ce) / 4, rel=1e-6)
    # a feature transform is applied before the classifier
    flip = evaluate(model, state, x, y, 2, transform=lambda z: z.flip(1))
    assert flip["accuracy"] == 0.25 and flip["per_class_accuracy"] == [0.0, 0.5]


def test_grayscale_convolutional_training_runs_channels_last_and_returns_nchw():
    """1-channel images of a CNN train in NHWC on a CPU (oneDNN's fast path); what leaves
    the client is NCHW again, and the trained weights match NCHW training up to fp32
    rounding."""
    import torch

    from privfedcal.algorithms.algorithm import create_algorithm
    from privfedcal.federation.local import (
        LocalSpec,
        clone_state,
        train_client,
        train_memory_format,
    )
    from privfedcal.models.cnn import SimpleCNN
    from privfedcal.settings.sections import DataSettings, TrainingSettings

    torch.manual_seed(0)
    model = SimpleCNN(num_classes=3, in_channels=1, image_size=28)
    x, y = torch.randn(40, 1, 28, 28), torch.randint(0, 3, (40,))
    assert train_memory_format(model, x) == torch.channels_last
    assert train_memory_format(model, torch.randn(4, 3, 28, 28)) == torch.contiguous_format
    start = clone_state(model)
    spec = LocalSpec(TrainingSettings(local_epochs=1, batch_size=8, lr=0.05, momentum=0.9,
                                      weight_decay=1e-4, seed=0), DataSettings(augment=False))
    algo = create_algorithm("fedavg", num_classes=3)
    idx = torch.arange(40)
    got = train_client(model, algo, start, None, x, y, idx, spec, 0, 0).state
    assert all(v.is_contiguous() for v in got.values())
    assert all(p.is_contiguous() for p in model.parameters())
    # the same steps with the layout forced to NCHW
    import privfedcal.federation.local as local

    original = local.train_memory_format
    local.train_memory_format = lambda *_: torch.contiguous_format
    try:
        want = train_client(model, algo, start, None, x, y, idx, spec, 0, 0).state
    finally:
        local.train_memory_format = original
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


def _reference_local_training(model, algo, start, x_all, y_all, idx, spec, round_, client):
    """Local training written plainly: one gather per step, ``torch.optim.SGD``, the loss
    summed on a float32 scalar step by step. ``train_client`` must take exactly its steps."""
    from privfedcal.data.augment import apply_augmentation, draw_augmentation
    from privfedcal.federation.local import train_memory_format

    g = make_generator(spec.training.seed, round_, client, 1)
    model.load_state_dict(start)
    model.train()
    fmt = train_memory_format(model, x_all)
    model.to(memory_format=fmt)
    r = spec.recipe
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=r.lr,
                          momentum=r.momentum, weight_decay=r.weight_decay)
    n, total, steps = int(idx.numel()), torch.zeros(()), 0
    for _ in range(r.local_epochs):
        order = idx[torch.randperm(n, generator=g)]
        draws = draw_augmentation(n, g) if spec.data.augment else ()
        for s in range(0, n, r.batch_size):
            batch = order[s:s + r.batch_size]
            if batch.numel() < 2:
                continue
            x, y = x_all[batch], y_all[batch]
            if spec.data.augment:
                x = apply_augmentation(x, tuple(d[..., s:s + r.batch_size] for d in draws))
            loss = algo.local_loss(model, x.contiguous(memory_format=fmt), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
            steps += 1
    model.to(memory_format=torch.contiguous_format)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(total) / steps


@pytest.mark.parametrize("case", ["mlp", "mlp-augment", "cnn-gray-augment",
                                  "cnn-rgb-augment"])
def test_train_client_takes_the_reference_steps_bit_for_bit(case, monkeypatch):
    """Chunked gathers, the in-place weight decay, the deferred loss sum and (for the MLP)
    the hand-written steps change nothing: the trained state and the mean loss equal the
    plain loop's exactly, across chunk boundaries and with a last batch of one (skipped)."""
    import privfedcal.federation.local as local
    from privfedcal.algorithms.algorithm import create_algorithm
    from privfedcal.federation.local import LocalSpec, clone_state, train_client
    from privfedcal.models.cnn import SimpleCNN
    from privfedcal.models.mlp import MLP
    from privfedcal.settings.sections import DataSettings, TrainingSettings

    torch.manual_seed(0)
    channels, size = {"mlp": (1, 8), "mlp-augment": (1, 8), "cnn-gray-augment": (1, 28),
                      "cnn-rgb-augment": (3, 32)}[case]
    if case.startswith("mlp"):
        model = MLP(num_classes=4, in_channels=channels, image_size=size)
    else:
        model = SimpleCNN(num_classes=4, in_channels=channels, image_size=size)
    x, y = torch.randn(60, channels, size, size), torch.randint(0, 4, (60,))
    # 49 scattered samples: 12 batches of 4, then a batch of one that is skipped
    idx = torch.tensor([i for i in range(60) if i % 7 != 3])[:49]
    spec = LocalSpec(TrainingSettings(local_epochs=2, batch_size=4, lr=0.05, momentum=0.9,
                                      weight_decay=1e-3, seed=3),
                     DataSettings(augment=case.endswith("augment")))
    algo = create_algorithm("fedavg", num_classes=4)
    start = clone_state(model)
    row = x[:1].numel() * x.element_size()
    monkeypatch.setattr(local, "EPOCH_CHUNK_BYTES", row * 9)  # chunks of 2 batches
    assert local.epoch_chunk(x, 4) == 8
    got = train_client(model, algo, start, None, x, y, idx, spec, 2, 5)
    want_state, want_loss = _reference_local_training(model, algo, start, x, y, idx, spec, 2, 5)
    assert got.loss == want_loss
    assert got.state.keys() == want_state.keys()
    for k in want_state:
        assert torch.equal(got.state[k], want_state[k]), k


def test_mean_loss_sums_in_float32_in_step_order():
    from privfedcal.federation.local import mean_loss

    values = [torch.tensor(v, dtype=torch.float32) for v in (1e8, 1.0, -1e8, 3.0, 0.1)]
    total = torch.zeros(())
    for v in values:
        total += v
    assert mean_loss(values) == float(total) / 5
    # the float32 steps matter: 1e8 + 1 rounds to 1e8 in float32, so the sum is 3.1, not 4.1
    assert mean_loss(values) == pytest.approx(3.1 / 5, rel=1e-6)
    assert mean_loss([]) == 0.0
