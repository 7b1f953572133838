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
