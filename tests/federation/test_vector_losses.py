"""Each vectorised loss on a padded batch equals the method's own ``local_loss`` on the real
rows (the reference), value and gradient: padding rows carry weight 0 and change nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.func import functional_call

from privfedcal.algorithms import ALGORITHMS, create_algorithm
from privfedcal.federation.local import clone_state
from privfedcal.federation.vector_losses import vector_loss_of, weighted_ce
from privfedcal.federation.vectorised import _FeaturesAndLogits
from privfedcal.models import create_model
from privfedcal.seeding import make_generator

_PARAMS = {"fedprox": {"mu": 2.0}, "clsprox": {"mu": 2.0}, "moon": {"mu": 5.0}}


def test_weighted_ce_is_the_mean_over_real_rows():
    g = torch.Generator().manual_seed(1)
    logits, y = torch.randn(6, 4, generator=g), torch.randint(0, 4, (6,), generator=g)
    w = torch.tensor([1.0, 1, 0, 1, 0, 0])
    # the reference: cross-entropy of the three real rows, written out
    real = logits[[0, 1, 3]]
    want = (real.logsumexp(1) - real[torch.arange(3), y[[0, 1, 3]]]).mean()
    torch.testing.assert_close(weighted_ce(logits, y, w), want)


@pytest.mark.parametrize("real_rows", [1, 2, 5])
@pytest.mark.parametrize("method", sorted(n for n in ALGORITHMS.names()
                                          if vector_loss_of(ALGORITHMS.get(n))))
def test_padded_loss_is_the_methods_local_loss(method, real_rows):
    g = torch.Generator().manual_seed(real_rows)
    model = create_model("mlp", num_classes=10, in_channels=1, image_size=8,
                         generator=make_generator(0, 0, 0, 7))
    algo = create_algorithm(method, num_classes=10, **_PARAMS.get(method, {}))
    algo.configure_model(model, make_generator(0, 0, 0, 8))
    global_state = clone_state(model)
    # a moved model (as after some local steps) and, for MOON, a previous local model
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    prev = {k: v + 0.02 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in global_state.items()}
    x = torch.randn(8, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    w = (torch.arange(8) < real_rows).float()

    # the reference: the method's own hooks on the real rows only
    live = clone_state(model)
    model.load_state_dict(global_state)
    algo.begin_client(model, global_state, prev if method == "moon" else None)
    model.load_state_dict(live)
    want = algo.local_loss(model, x[:real_rows], y[:real_rows])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    want_grads = torch.autograd.grad(want, [dict(model.named_parameters())[n] for n in trainable])
    algo.end_client(model)

    view = _FeaturesAndLogits(model)
    fixed = {f"model.{k}": v for k, v in live.items() if k not in trainable}
    params = {f"model.{n}": live[n].clone().requires_grad_() for n in trainable}
    anchor = {f"model.{n}": global_state[n] for n in trainable}
    vloss = vector_loss_of(algo)
    trainer = SimpleNamespace(x=x, model=model)
    ext = {k: v[0] for k, v in vloss.prepare(trainer, global_state, [prev]).items()}

    def forward(p, xb):
        return functional_call(view, {**fixed, **p}, (xb,))

    got = vloss.loss(algo, forward, params, anchor, x, y, w, ext)
    got_grads = torch.autograd.grad(got, list(params.values()))
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
