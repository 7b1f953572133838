"""Batched inversion (attacks/reconstruction/engine.py) against the one-target-at-a-time path.

The reference is the same inversion run alone per target with its own seeded generator
(what ``execute`` does with ``attack_batch=1``); the batch must give every target the same
images, restart losses, stopping step and stop reason within float32 rounding, while the
targets differ in image count (padding), kind of loss and stopping step. The Adam update is
checked against ``torch.optim.Adam`` itself.
"""

from __future__ import annotations

import pytest
import torch

from privfedcal.attacks.reconstruction.engine import _adam_step
from privfedcal.attacks.reconstruction.feature_inversion import (
    FeatureTarget,
    InversionConfig,
    invert_features,
    invert_features_many,
)
from privfedcal.attacks.reconstruction.gradient_inversion import _head_gradient
from privfedcal.attacks.reconstruction.rounds import (
    invert_class_gradients,
    invert_class_gradients_many,
)

MEAN, STD = [0.5], [0.25]  # as in conftest.py
KW = dict(image_shape=(1, 4, 4), mean=MEAN, std=STD)


def test_adam_step_is_torch_adam():
    """Same parameter after 30 steps as torch.optim.Adam with a changing lr, per target."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 5, generator=g)
    grads = [torch.randn(2, 3, 5, generator=g) for _ in range(30)]
    lrs = [(0.1 * 0.97**k, 0.05 * 0.97**k) for k in range(30)]  # target 1: half the step
    ref = []
    for t in range(2):
        p = x0[t].clone().requires_grad_(True)
        opt = torch.optim.Adam([p], lr=0.1)
        for k, grad in enumerate(grads):
            opt.param_groups[0]["lr"] = lrs[k][t]
            p.grad = grad[t].clone()
            opt.step()
        ref.append(p.detach())
    x, m, v = x0.clone(), torch.zeros_like(x0), torch.zeros_like(x0)
    for k, grad in enumerate(grads):
        step = k + 1
        sizes = torch.tensor([lr / (1 - 0.9**step) for lr in lrs[k]]).view(2, 1, 1)
        _adam_step(x, grad, m, v, step, sizes)
    torch.testing.assert_close(x, torch.stack(ref), rtol=0, atol=1e-6)  # a few ulps


def _targets(model, images):
    with torch.no_grad():
        z = model.features((images - 0.5) / 0.25)

    def stats(zz):
        return FeatureTarget.class_stats(zz.shape[0], zz.mean(0), torch.cov(zz.T))

    return [FeatureTarget.raw(z[:2]), stats(z[2:6]), FeatureTarget.raw(z[6:7]), stats(z[5:9]),
            FeatureTarget.class_mean(z[:3].mean(0), 3, batch=True), stats(z[:2]),
            FeatureTarget.class_mean(z[3:5].mean(0), 2, batch=True), FeatureTarget.raw(z[3:6])]


@pytest.mark.parametrize("jitter", [0, 1])
def test_batch_equals_one_at_a_time(toy, jitter):
    """Eight targets of four kinds and 1-4 images, a BatchNorm prior, targets stopping at
    different checks (plateau) and at the cap: every result is the one it gets alone."""
    model = toy(mlp=True, bn=True)
    model.bn.running_mean.fill_(0.1)
    model.bn.running_var.fill_(1.3)
    images = torch.rand(9, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    targets = _targets(model, images)
    cfg = InversionConfig(steps=300, restarts=3, check_every=25, patience=1, tol=1e-3,
                          jitter=jitter, min_improvement=0.1, min_lr_ratio=0.3)
    alone = [invert_features(model, t, generator=torch.Generator().manual_seed(10 + i),
                             config=cfg, **KW) for i, t in enumerate(targets)]
    together = invert_features_many(
        model, targets, generators=[torch.Generator().manual_seed(10 + i)
                                    for i in range(len(targets))], config=cfg, **KW)
    for a, b in zip(alone, together, strict=True):
        assert a.mode == b.mode and a.images.shape == b.images.shape
        assert (a.convergence.steps, a.convergence.stopped) == (b.convergence.steps,
                                                                b.convergence.stopped)
        torch.testing.assert_close(b.images, a.images, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.restart_losses, a.restart_losses, rtol=1e-5, atol=1e-6)
        assert b.convergence.error == pytest.approx(a.convergence.error, rel=1e-4, abs=1e-6)
    stops = {(r.convergence.steps, r.convergence.stopped) for r in alone}
    assert len(stops) >= 3  # targets leave the batch at different steps: the exit is tested


def test_batch_stops_each_target_when_converged(linear_model, images):
    """An easy target converges at an early check, a hard one (tol unreachable for it) runs
    on; the converged one keeps the step and images it had when it stopped alone."""
    with torch.no_grad():
        z = linear_model.features((images - 0.5) / 0.25)
    targets = [FeatureTarget.raw(z[:1]), FeatureTarget.raw(z * 50)]  # far outside the box
    cfg = InversionConfig(steps=2000, restarts=2, tol=1e-4, check_every=50, tv_weight=0.0,
                          l2_weight=0.0)
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]  # noqa: E731
    together = invert_features_many(linear_model, targets, generators=gens(), config=cfg, **KW)
    alone = [invert_features(linear_model, t, generator=g, config=cfg, **KW)
             for t, g in zip(targets, gens(), strict=True)]
    easy, hard = together
    assert easy.convergence.stopped == "converged" and easy.convergence.error <= 1e-4
    assert hard.convergence.stopped != "converged" and hard.convergence.steps > \
        easy.convergence.steps
    for a, b in zip(alone, together, strict=True):
        assert a.convergence == b.convergence or (
            a.convergence.steps == b.convergence.steps and a.convergence.error <= 1e-4)
        # at a feature error of 1e-5 the images are pinned to float32 noise (~1e-5)
        torch.testing.assert_close(b.images, a.images, rtol=0, atol=1e-4)


def test_class_gradients_across_rounds_batched(toy):
    """Three targets (labels 0-2, n = 1, 2, 3) of the same two releases: batched = alone."""
    model = toy(mlp=True)
    states = [{k: v + 0.05 * r for k, v in model.state_dict().items()} for r in range(2)]
    g = torch.Generator().manual_seed(5)
    heads = [(torch.randn(3, 32, generator=g), torch.randn(3, generator=g)) for _ in range(2)]
    targets = []
    for label, n in ((0, 1), (1, 2), (2, 3)):
        x = (torch.rand(n, 1, 4, 4, generator=g) - 0.5) / 0.25
        grads = []
        for st, (w, b) in zip(states, heads, strict=True):
            model.load_state_dict(st)
            with torch.no_grad():
                grads.append(_head_gradient(model.features(x), w, b, label))
        targets.append((grads, label, n))
    cfg = InversionConfig(steps=120, restarts=2, check_every=20, patience=1, tv_weight=1e-2,
                          l2_weight=0.0, bn_weight=0.0, jitter=0)
    alone = [invert_class_gradients(model, states, heads, gr, lab, n, config=cfg,
                                    generator=torch.Generator().manual_seed(i), **KW)
             for i, (gr, lab, n) in enumerate(targets)]
    together = invert_class_gradients_many(
        model, states, heads, targets, generators=[torch.Generator().manual_seed(i)
                                                   for i in range(3)], config=cfg, **KW)
    for a, b in zip(alone, together, strict=True):
        assert a.convergence.steps == b.convergence.steps
        # the batched kernels sum in another order: float32 differences of ~1e-7, which 120
        # optimiser steps on a multi-sample target amplify on some CPUs (images 0.028 apart,
        # cosines 0.9260 and 0.9284 on one 2-core machine, at the code of the previous
        # release too); a wrong batching (another target's gradient, a shared generator)
        # moves the images by O(1) and the cosine far more
        torch.testing.assert_close(b.images, a.images, rtol=0, atol=0.1)
        assert b.gradient_cosine == pytest.approx(a.gradient_cosine, abs=1e-2)


def test_chunks_cut_where_padding_costs_more_than_a_batch():
    """By hand, overhead 64 images: padding 6 targets of <= 12 images up to 99 would cost
    6 * 87 = 522 > 64, so the two 99s form their own batch; 1 -> 12 pads 5 * 5 = 25 < 64."""
    from privfedcal.attacks.reconstruction.runner import CHUNK_OVERHEAD_IMAGES, _chunks

    assert CHUNK_OVERHEAD_IMAGES == 64
    images = [1, 1, 1, 5, 7, 12, 99, 99]
    order = list(range(10, 18))
    assert _chunks(order, images, 32) == [order[:6], order[6:]]
    assert _chunks(order, images, 2) == [order[i:i + 2] for i in range(0, 8, 2)]
    assert _chunks(order, images, 1) == [[i] for i in order]


def test_traces_see_each_targets_own_images(linear_model, images):
    """Each target's trace sees its best restart's (B_t, 1, 4, 4) pixels at every check and
    once more at its end, as alone; the last one is the returned reconstruction."""
    with torch.no_grad():
        z = linear_model.features((images - 0.5) / 0.25)
    targets = [FeatureTarget.raw(z[:1]), FeatureTarget.raw(z)]
    cfg = InversionConfig(steps=120, restarts=2, check_every=50)
    seen: dict[int, list[tuple[int, tuple[int, ...]]]] = {0: [], 1: []}
    last: dict[int, torch.Tensor] = {}

    def tracer(t):
        def trace(step, pixels):
            seen[t].append((step, tuple(pixels.shape)))
            last[t] = pixels
        return trace

    res = invert_features_many(linear_model, targets, config=cfg, traces=[tracer(0), tracer(1)],
                               generators=[torch.Generator().manual_seed(s) for s in (0, 1)],
                               **KW)
    assert seen[0] == [(50, (1, 1, 4, 4)), (100, (1, 1, 4, 4)), (120, (1, 1, 4, 4))]
    assert seen[1] == [(50, (3, 1, 4, 4)), (100, (3, 1, 4, 4)), (120, (3, 1, 4, 4))]
    for t in (0, 1):
        torch.testing.assert_close(last[t], res[t].images)


def test_shape_of_is_what_the_optimiser_is_given(toy):
    """``shape_of`` (the runner's grouping key) agrees with how each target is posed."""
    from privfedcal.attacks.reconstruction.feature_targets import pose, shape_of

    model = toy(mlp=True)
    images = torch.rand(9, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    targets = _targets(model, images) + [
        FeatureTarget.class_mean(torch.ones(32), 7),  # one image for a mean of 7
        FeatureTarget.raw(torch.ones(32)),
        FeatureTarget.class_stats(5, torch.ones(32), torch.eye(32), mode="features")]
    got = [shape_of(t) for t in targets]
    assert got == [(p.term, p.batch) for p in (pose(t, torch.device("cpu"), torch.float32)
                                               for t in targets)]
    assert got[-3:] == [("per-image", 1), ("per-image", 1), ("per-image", 5)]
    assert {g[0] for g in got} == {"per-image", "mean", "stats"}



class Counted:
    """A ``WorkSink`` that keeps every report as (restart-steps, image-steps)."""

    def __init__(self):
        self.plans, self.runs, self.saves, self.stops = [], [], [], []

    def stopped(self, run, planned):
        self.stops.append((run, planned))

    def planned(self, steps, images):
        self.plans.append((steps, images))

    def advance(self, steps, images):
        self.runs.append((steps, images))

    def saved(self, steps, images):
        self.saves.append((steps, images))


def test_engine_reports_every_step_and_what_early_stops_save(linear_model, images):
    """Inside ``reporting`` the engine announces targets x cap x restarts, reports each step
    of each active target's restarts, and what an early stop leaves unrun: run + saved ==
    planned, in restart-steps and in image-steps (a target of n images counts n a step),
    and the steps run are the targets' own stopping steps."""
    from privfedcal.attacks.reconstruction.engine import reporting

    with torch.no_grad():
        z = linear_model.features((images - 0.5) / 0.25)
    n = z.shape[0]
    targets = [FeatureTarget.raw(z[:1]), FeatureTarget.raw(z * 50)]  # 1 and n images
    cap, r = 600, 2
    cfg = InversionConfig(steps=cap, restarts=r, tol=1e-4, check_every=50, tv_weight=0.0,
                          l2_weight=0.0)
    sink = Counted()
    with reporting(sink):
        easy, hard = invert_features_many(
            linear_model, targets, config=cfg, **KW,
            generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    a, b = easy.convergence.steps, hard.convergence.steps
    assert a < b <= cap  # an early stop happened: what it saves is tested
    assert sink.plans == [(2 * cap * r, (1 + n) * cap * r)]
    assert len(sink.runs) == b  # one report per step
    assert sum(s for s, _ in sink.runs) == r * (a + b)
    assert sum(i for _, i in sink.runs) == r * (a + n * b)
    assert sum(s for s, _ in sink.saves) == r * ((cap - a) + (cap - b))
    assert sum(i for _, i in sink.saves) == r * ((cap - a) + n * (cap - b))
    # each target's stop: the image-steps it ran of those its cap allowed
    assert sorted(sink.stops) == sorted([(r * a, r * cap), (r * n * b, r * n * cap)])
    # outside the block nothing is reported
    invert_features_many(linear_model, targets[:1], config=cfg, **KW,
                         generators=[torch.Generator().manual_seed(1)])
    assert len(sink.plans) == 1
