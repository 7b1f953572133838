"""federation/chain_steps.py: the MLP's hand-written steps are autograd's and PlainSGD's bit
for bit, and anything they cannot reproduce trains through autograd."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from privfedcal.algorithms.algorithm import create_algorithm
from privfedcal.federation.chain_steps import ChainSteps, chain_linears, chain_steps
from privfedcal.federation.local import AutogradSteps
from privfedcal.models.mlp import MLP
from privfedcal.settings.floors import Recipe


def _recipe(lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 1e-5) -> Recipe:
    return Recipe(lr=lr, momentum=momentum, weight_decay=weight_decay, batch_size=32,
                  local_epochs=1)


def _twins(channels: int = 1, size: int = 8, classes: int = 10) -> tuple[MLP, MLP]:
    torch.manual_seed(0)
    a = MLP(num_classes=classes, in_channels=channels, image_size=size)
    b = MLP(num_classes=classes, in_channels=channels, image_size=size)
    b.load_state_dict(a.state_dict())
    return a, b


def _train_both(recipe: Recipe, batches: list[int], seed: int, channels: int = 1,
                size: int = 8, classes: int = 10) -> None:
    """Train twins on the same batches, one by hand and one through autograd, and compare
    every loss and the final parameters exactly."""
    by_hand, by_autograd = _twins(channels, size, classes)
    algo = create_algorithm("fedavg", num_classes=classes)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, channels, size, size, generator=g) for n in batches]
    ys = [torch.randint(0, classes, (n,), generator=g) for n in batches]
    hand = chain_steps(by_hand, algo, xs[0], ys[0], recipe)
    assert isinstance(hand, ChainSteps)
    auto = AutogradSteps(by_autograd, algo, recipe, amp=False)
    for x, y in zip(xs, ys, strict=True):
        assert torch.equal(hand.step(x, y), auto.step(x, y))
    hand.finish()
    auto.finish()
    for (name, p), q in zip(by_hand.named_parameters(), by_autograd.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 1e-5), (0.0, 0.0), (0.5, 0.0),
                                                   (0.0, 1e-3)])
def test_hand_written_steps_equal_autograd_bit_for_bit(momentum, weight_decay):
    _train_both(_recipe(momentum=momentum, weight_decay=weight_decay), [32] * 6 + [7, 2], 1)


def test_hand_written_steps_on_colour_images_and_other_class_counts():
    _train_both(_recipe(lr=0.2), [16, 16, 5], 2, channels=3, size=4, classes=3)


@settings(max_examples=15, deadline=None)
@given(lr=st.sampled_from([0.01, 0.05, 0.3]), momentum=st.sampled_from([0.0, 0.9]),
       weight_decay=st.sampled_from([0.0, 1e-5, 5e-4]),
       batches=st.lists(st.integers(2, 40), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_hand_written_steps_equal_autograd_for_any_recipe_and_batches(lr, momentum,
                                                                      weight_decay, batches,
                                                                      seed):
    _train_both(_recipe(lr, momentum, weight_decay), batches, seed)


def test_the_model_holds_the_trained_parameters_after_finish():
    model, _ = _twins()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    steps = chain_steps(model, create_algorithm("fedavg", num_classes=10), x, y, _recipe())
    assert steps is not None
    steps.step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    steps.finish()
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def _eligible(model: nn.Module, algo_name: str = "fedavg", x: torch.Tensor | None = None,
              y: torch.Tensor | None = None) -> bool:
    x = torch.randn(4, 1, 8, 8) if x is None else x
    y = torch.randint(0, 10, (4,)) if y is None else y
    algo = create_algorithm(algo_name, num_classes=10)
    return chain_steps(model, algo, x, y, _recipe()) is not None  # type: ignore[arg-type]


def test_the_mlp_under_the_plain_loss_is_taken_by_hand():
    assert _eligible(_twins()[0])
    assert len(chain_linears(_twins()[0]) or []) == 3


def test_a_method_with_its_own_loss_trains_through_autograd():
    for name in ("fedprox", "moon", "feduv"):
        assert not _eligible(_twins()[0], name), name


def test_another_model_or_a_subclass_trains_through_autograd():
    from privfedcal.models.cnn import SimpleCNN

    class Wider(MLP):
        pass

    assert not _eligible(SimpleCNN(num_classes=10, in_channels=1, image_size=16),
                         x=torch.randn(4, 1, 16, 16))
    assert not _eligible(Wider(num_classes=10, in_channels=1, image_size=8))
    changed = _twins()[0]
    changed.body[2] = nn.Tanh()  # not a ReLU
    assert chain_linears(changed) is None


def test_hooks_frozen_parameters_other_dtypes_and_no_grad_train_through_autograd():
    hooked = _twins()[0]
    hooked.body[1].register_forward_hook(lambda *_: None)
    assert not _eligible(hooked)
    tensor_hooked = _twins()[0]
    tensor_hooked.classifier.bias.register_hook(lambda g: g)
    assert not _eligible(tensor_hooked)
    handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        assert not _eligible(_twins()[0])
    finally:
        handle.remove()
    assert _eligible(_twins()[0])
    frozen = _twins()[0]
    frozen.classifier.weight.requires_grad_(False)
    assert not _eligible(frozen)
    assert not _eligible(_twins()[0], x=torch.randn(4, 1, 8, 8, dtype=torch.float64))
    assert not _eligible(_twins()[0], y=torch.randint(0, 10, (4,), dtype=torch.int32))
    with torch.no_grad():
        assert not _eligible(_twins()[0])


def test_hand_written_steps_equal_autograd_on_two_threads():
    """With two threads the products split their work differently; both paths still run
    the same kernels on the same operands."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _train_both(_recipe(), [32] * 10 + [5], 7)
        _train_both(_recipe(lr=0.2), [64] * 5, 8, channels=3, size=16)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["clsnorm", "freeze"])
def test_methods_that_reshape_or_freeze_the_head_train_through_autograd(name):
    """clsnorm parametrises the classifier's weight (row-normalised) and freezes its bias;
    freeze fixes the whole classifier: neither is the plain chain."""
    model = _twins()[0]
    algo = create_algorithm(name, num_classes=10)
    algo.configure_model(model, torch.Generator().manual_seed(0))
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    assert chain_steps(model, algo, x, y, _recipe()) is None
