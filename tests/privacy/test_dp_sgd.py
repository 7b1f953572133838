"""DP-SGD helper over opacus (privacy/dpsgd.py), checked against torch.func per-sample grads."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.dpsgd import (
    PoissonBatches,
    dpsgd_sample_rate,
    make_private_training,
    prepare_model,
)


class TinyNet(FeatureClassifier):
    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4) if norm else nn.Identity(),
                                  nn.ReLU(), nn.Flatten())
        self.feature_dim, self.num_classes = 4 * 4 * 4, 3
        self.classifier = nn.Linear(self.feature_dim, 3)

    def features(self, x):
        return self.body(x)


pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def data(n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def private(model, x, y, *, z, clip, batch, seed, lr=0.1, steps=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return make_private_training(model, opt, x, y, noise_multiplier=z, max_grad_norm=clip,
                                 batch_size=batch, generator=torch.Generator().manual_seed(seed),
                                 steps=steps)


def step(pt, xb, yb):
    pt.optimizer.zero_grad()
    F.cross_entropy(pt.model.classifier(pt.model.features(xb)), yb).backward()
    pt.optimizer.step()


def test_sample_rate():
    assert dpsgd_sample_rate(32, 100) == 0.32
    assert dpsgd_sample_rate(32, 10) == 1.0       # small clients: every example, every step
    with pytest.raises(UsageError):
        dpsgd_sample_rate(0, 10)


def test_prepare_model_swaps_batchnorm_for_groupnorm_and_keeps_the_class():
    torch.manual_seed(0)
    model = TinyNet()
    fixed = prepare_model(model)
    assert isinstance(fixed, TinyNet) and fixed is not model
    assert isinstance(fixed.body[1], nn.GroupNorm)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fixed.modules())
    plain = TinyNet(norm=False)
    assert prepare_model(plain) is plain
    x, y = data()
    with pytest.raises(UsageError, match="prepare_model"):
        private(model, x, y, z=1.0, clip=1.0, batch=8, seed=0)
    with pytest.raises(UsageError, match="must optimise"):
        make_private_training(fixed, torch.optim.SGD(model.parameters(), lr=0.1), x, y,
                              noise_multiplier=1.0, max_grad_norm=1.0, batch_size=8,
                              generator=torch.Generator())


def test_noise_free_step_equals_manual_per_sample_clip_and_average():
    torch.manual_seed(1)
    model = prepare_model(TinyNet())
    x, y = data(24)
    clip = 6.0                                  # per-sample norms here span ~4.7..8.8
    reference = copy.deepcopy(model)            # hook-free twin for torch.func
    pt = private(model, x, y, z=0.0, clip=clip, batch=12, seed=3)
    xb, yb = next(iter(pt.loader))
    assert 0 < len(xb) < len(x)
    params = {k: p.detach().clone() for k, p in reference.named_parameters()}

    def loss_one(p, xi, yi):
        return F.cross_entropy(functional_call(reference, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, xb, yb)
    norms = torch.cat([g.reshape(len(xb), -1) for g in per_sample.values()], 1).norm(dim=1)
    assert bool((norms > clip).any()) and bool((norms < clip).any())   # clipping matters
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)    # opacus's clip factor
    expected_bs = pt.sample_rate * len(x)               # averages over the EXPECTED batch
    step(pt, xb, yb)
    for k, p in model.named_parameters():
        ref = torch.einsum("i,i...->...", factor, per_sample[k]) / expected_bs
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-6)
    assert bool((norms * factor <= clip).all())       # every contribution inside the ball


def test_noisy_step_changes_parameters_reproducibly():
    x, y = data(16)

    def run(seed):
        torch.manual_seed(2)
        model = prepare_model(TinyNet())
        before = [p.detach().clone() for p in model.parameters()]
        pt = private(model, x, y, z=1.0, clip=1.0, batch=8, seed=seed, steps=1)
        for xb, yb in pt.loader:
            step(pt, xb, yb)
        pt.close()
        return before, [p.detach().clone() for p in model.parameters()]

    before, a = run(5)
    _, b = run(5)
    _, c = run(6)
    assert all(not torch.equal(p0, p1) for p0, p1 in zip(before, a, strict=True))
    assert all(torch.equal(p1, p2) for p1, p2 in zip(a, b, strict=True))
    assert any(not torch.equal(p1, p3) for p1, p3 in zip(a, c, strict=True))


def test_empty_poisson_batch_gives_a_noise_only_step_and_close_removes_hooks():
    torch.manual_seed(3)
    model = prepare_model(TinyNet())
    x, y = data(50)
    twin = copy.deepcopy(model)
    pt = private(model, x, y, z=1.0, clip=1.0, batch=1, seed=0)       # q = 0.02
    empty = next((b for b in PoissonBatches(x, y, 1e-9, 5, torch.Generator())), None)
    assert empty is not None and len(empty[0]) == 0
    step(pt, *empty)
    grads = [p.grad.clone() for p in model.parameters()]
    assert all(bool(torch.isfinite(g).all()) and bool((g != 0).any()) for g in grads)
    # the shortcut without a forward pass draws the same noise from the same generator
    pt_twin = private(twin, x, y, z=1.0, clip=1.0, batch=1, seed=0)
    pt_twin.noise_only_step()
    assert all(torch.equal(p.grad, g) for p, g in zip(twin.parameters(), grads, strict=True))
    # noise std = z * clip / (q n) = 1 / (0.02 * 50) = 1
    flat = torch.cat([g.flatten() for g in grads])
    assert 0.7 < float(flat.std()) < 1.3
    pt_twin.close()
    plain = pt.close()
    assert plain is model
    model.zero_grad()
    F.cross_entropy(model(x[:4]), y[:4]).backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_poisson_batches_include_each_example_with_probability_q():
    x = torch.arange(40.0)
    loader = PoissonBatches(x, x, 0.25, 2000, torch.Generator().manual_seed(0))
    hits = torch.zeros(40)
    sizes = []
    for xb, yb in loader:
        assert torch.equal(xb, yb)
        hits[xb.long()] += 1
        sizes.append(len(xb))
    # inclusion ~ Binomial(2000, 0.25): std ~19.4 counts, 5 sigma per example
    assert float((hits - 500).abs().max()) < 5 * (2000 * 0.25 * 0.75) ** 0.5

    def batches(seed):
        return [b[0] for b in PoissonBatches(x, x, 0.25, 3, torch.Generator().manual_seed(seed))]

    assert all(torch.equal(a, b) for a, b in zip(batches(1), batches(1), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(batches(1), batches(2), strict=True))
    assert sum(sizes) / len(sizes) == pytest.approx(10, rel=0.03)


def test_poisson_batches_chunked_draw_equals_one_mask_per_step():
    # The masks of several steps are drawn as one (steps, n) block; each step's batch must be
    # exactly the members of its row, whatever the chunking (independent reference: the same
    # uniforms drawn as a block, thresholded and read row by row with numpy).
    x = torch.arange(37.0)
    q, steps = 0.3, 11
    for chunk in (37 * 11, 37 * 4, 37, 1):
        loader = PoissonBatches(x, x, q, steps, torch.Generator().manual_seed(5))
        loader.CHUNK_ELEMENTS = chunk
        got = [b[0].long().tolist() for b in loader]
        g = torch.Generator().manual_seed(5)
        per = max(1, chunk // 37)
        want = []
        for first in range(0, steps, per):
            u = torch.rand(min(per, steps - first), 37, generator=g).numpy()
            want += [list(np.flatnonzero(row < q)) for row in u]
        assert got == want and len(got) == steps


# ---- a public schedule: nothing depends on the private client size (docs/threat-model.md) ---

@pytest.mark.parametrize("n", [1, 31, 80, 81, 500])
def test_public_rate_fixes_steps_and_scale_whatever_the_client_size(n):
    """With the federation's public (q, steps, expected batch), clients of n and n+1 examples
    take the same number of steps and divide by the same expected batch size (the old
    schedule, E * round(n / B) steps at q = B / n, told 80 from 81 examples apart)."""
    from privfedcal.privacy.dpsgd_local import schedule

    q, steps = schedule(200, 32, 2)
    assert (q, steps) == (0.16, 2 * round(200 / 32))
    seen = []
    for size in (n, n + 1):
        x, y = data(size)
        net = TinyNet(norm=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        pt = make_private_training(net, opt, x, y, noise_multiplier=1.0, max_grad_norm=1.0,
                                   batch_size=32, generator=torch.Generator().manual_seed(0),
                                   steps=steps, sample_rate=q, expected_batch_size=q * 200)
        seen.append((len(pt.loader), pt.sample_rate, pt.optimizer.expected_batch_size))
        pt.close()
    assert seen[0] == seen[1] == (steps, q, q * 200)


def test_rate_and_expected_batch_go_together():
    x, y = data(10)
    net = TinyNet(norm=False)
    with pytest.raises(UsageError, match="together"):
        make_private_training(net, torch.optim.SGD(net.parameters(), lr=0.1), x, y,
                              noise_multiplier=1.0, max_grad_norm=1.0, batch_size=4,
                              generator=torch.Generator(), sample_rate=0.5)


def test_run_schedule_and_epsilon_do_not_depend_on_client_sizes(tmp_path, tiny_cfg,
                                                                monkeypatch):
    """Two partitions of very different client sizes: every client runs the same number of
    Poisson steps at the same rate (the old schedule gave clients of 358 and 512 examples 11
    and 16 steps), the same noise, the same accounted epsilon, and no loss is recorded."""
    import json

    import privfedcal.privacy.dpsgd as dpsgd
    from privfedcal.experiment import build_simulator

    used = []  # (sample rate, steps) of every client's Poisson batches, as run
    init = dpsgd.PoissonBatches.__init__

    def spy(self, x, y, sample_rate, steps, generator):
        used.append((sample_rate, steps))
        init(self, x, y, sample_rate, steps, generator)

    monkeypatch.setattr(dpsgd.PoissonBatches, "__init__", spy)
    specs, eps = [], []
    for alpha in (0.1, 100.0):
        # a fixed data seed: sizes that really differ (a protected run's is fresh otherwise)
        cfg = tiny_cfg(method="fedavg", dp_eps=4.0, dp_train=True, clients=3, rounds=1,
                       alpha=alpha, out=str(tmp_path / f"a{alpha}"), data_seed=0)
        sim = build_simulator(cfg, tmp_path / f"a{alpha}")
        sizes = sorted(int(p.numel()) for p in sim.exp.parts)
        summary = sim.run()
        dp = sim.exp.spec.dp_sgd
        specs.append((dp.sample_rate, dp.steps, dp.expected_batch_size, dp.noise_multiplier))
        per_client = summary["privacy"]["per_client_epsilon"]
        assert len(set(per_client.values())) == 1, per_client
        eps.append(next(iter(per_client.values())))
        rows = [json.loads(line) for line in (tmp_path / f"a{alpha}" / "clients.jsonl").open()]
        assert all(c["train_loss"] is None for r in rows for c in r["clients"])
        assert sim.history[-1]["train_loss"] is None
        if alpha == 0.1:
            assert sizes[-1] > sizes[0] + 100  # the client sizes really differ
    assert specs[0] == specs[1]
    assert eps[0] == pytest.approx(eps[1])
    assert len(used) == 6 and set(used) == {specs[0][:2]}
