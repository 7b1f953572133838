"""CReFF: analytic head gradients == autograd, Eq. 4/6 on hand values, matching, resume."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.calibration.creff import (
    DP_CLIENT_DRAWS,
    CReFF,
    CReFFParams,
    GradTask,
    aggregate_gradients,
    capped_per_class,
    class_mean_grads,
    content_keys,
    matching_loss,
    per_sample_head_grads,
    release_schedule,
)
from privfedcal.errors import UploadRejected, UsageError
from privfedcal.privacy.bound import NoBound
from privfedcal.settings.floors import PrivacyOptions

torch.set_num_threads(1)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 5), st.integers(0, 10**6))
def test_per_sample_grads_equal_autograd(n, d, c, seed):
    z, w, b = _rand(n, d, seed=seed), _rand(c, d, seed=seed + 1), _rand(c, seed=seed + 2)
    y = torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(seed))
    got = per_sample_head_grads(z, y, w, b)
    for i in range(n):
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        gw, gb = torch.autograd.grad(F.cross_entropy(z[i:i + 1] @ wi.T + bi, y[i:i + 1]), (wi, bi))
        torch.testing.assert_close(got[i], torch.cat([gw, gb[:, None]], dim=1))


def test_class_mean_grads_and_matching_gradient_equal_autograd():
    c, m, d = 3, 4, 5
    s = _rand(c, m, d, seed=1).requires_grad_()
    w, b = _rand(c, d, seed=2), _rand(c, seed=3)
    target = _rand(c, c, d + 1, seed=4)
    mask = torch.tensor([True, False, True])
    ours = class_mean_grads(s, w, b)
    # reference: Eq. 5 by autograd with a graph through the gradient (create_graph=True)
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = []
    for k in range(c):
        loss = F.cross_entropy(s[k] @ wl.T + bl, torch.full((m,), k))
        gw, gb = torch.autograd.grad(loss, (wl, bl), create_graph=True)
        ref.append(torch.cat([gw, gb[:, None]], dim=1))
    ref = torch.stack(ref)
    torch.testing.assert_close(ours, ref)
    g_ours = torch.autograd.grad(matching_loss(ours, target, mask), s)[0]
    g_ref = torch.autograd.grad(matching_loss(ref, target, mask), s)[0]
    torch.testing.assert_close(g_ours, g_ref)
    assert g_ours.abs().sum() > 0 and torch.equal(g_ours[1], torch.zeros(m, d, dtype=torch.float64))


def test_matching_loss_hand_value():
    # C = 2: class 0 rows cos = 1 and 0 -> (0 + 1)/2; class 1 rows cos = -1 and 1 -> (2 + 0)/2
    g_fed = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [2.0, 0.0]]])
    g_agg = torch.tensor([[[3.0, 0.0], [1.0, 0.0]], [[-1.0, -1.0], [5.0, 0.0]]])
    assert matching_loss(g_fed, g_agg, torch.tensor([True, True])).item() == pytest.approx(1.5)
    assert matching_loss(g_fed, g_agg, torch.tensor([True, False])).item() == pytest.approx(0.5)
    assert matching_loss(g_fed, g_agg, torch.tensor([True, True]), "sum").item() == pytest.approx(3.0)


def test_grad_task_payloads(helpers):
    model = helpers.TinyModel(3, 3).eval()
    x = _rand(7, 3, seed=5).float()
    y = torch.tensor([0, 0, 2, 0, 2, 2, 2])                      # class 1 absent
    w, b = _rand(3, 3, seed=6).float(), _rand(3, seed=7).float()
    g = per_sample_head_grads(x, y, w, b).double()
    sums = torch.stack([g[y == k].sum(0) for k in range(3)])
    bound = helpers.NormBound(1e6)
    sample = GradTask(w, b, 3, "sample", batch_size=2).compute(model, x, y, bound)
    assert bound.kinds and set(bound.kinds) == {"class-gradient"}
    torch.testing.assert_close(sample["grad"], sums)
    assert sample["count"].tolist() == [3.0, 0.0, 4.0]
    client = GradTask(w, b, 3, "client").compute(model, x, y, bound)
    torch.testing.assert_close(client["grad"][0], sums[0] / 3)
    assert client["holders"].tolist() == [1.0, 0.0, 1.0]
    assert client["grad"].shape == (3, 3, 4) and not client["grad"][1].any()
    # clipping: every per-sample gradient has norm <= R, so each class sum is <= n_c R
    tight = GradTask(w, b, 3, "sample").compute(model, x, y, helpers.NormBound(0.01))
    assert tight["grad"][2].norm() <= 4 * 0.01 + 1e-9


def test_aggregation_eq4():
    grad = torch.stack([torch.full((2, 3), 6.0), torch.zeros(2, 3)])
    g, mask = aggregate_gradients({"grad": grad, "holders": torch.tensor([3.0, 0.0])}, "client", 2)
    assert mask.tolist() == [True, False] and torch.all(g[0] == 2.0) and not g[1].any()
    g, _ = aggregate_gradients({"grad": grad, "count": torch.tensor([12.0, 0.0])}, "sample", 2)
    assert torch.all(g[0] == 0.5)
    with pytest.raises(UploadRejected):
        aggregate_gradients({"grad": grad, "count": torch.ones(2)}, "client", 2)
    with pytest.raises(UploadRejected):
        aggregate_gradients({"grad": grad * float("nan"), "holders": torch.ones(2)}, "client", 2)


def _round(creff, ctx, r):
    ctx.round, ctx.generator = r, torch.Generator().manual_seed(100 + r)
    creff.after_round(ctx)
    return creff.last_round_info


# the fake clients hold 4-d feature vectors, not images: no DSA (tested on images below)
PARAMS = CReFFParams(features_per_class=8, match_steps=30, retrain_steps=100,
                     feature_momentum=0.5, dsa="none")


@pytest.mark.parametrize("weighting,reduction", [("client", "sum"), ("sample", "mean")])
def test_matching_loss_decreases_and_head_is_used(make_context, weighting, reduction):
    ctx = make_context()
    creff = CReFF(CReFFParams(features_per_class=8, match_steps=30, retrain_steps=100,
                              weighting=weighting, match_reduction=reduction, dsa="none"),
                  num_classes=3, feature_dim=4)
    assert creff.eval_state(ctx.global_state) is ctx.global_state
    info = _round(creff, ctx, 1)
    json.dumps(info)
    assert ctx.labels == ["creff-grad"] and info["matched_classes"] == 3
    assert info["match_loss_after"] < info["match_loss_before"]
    state = creff.eval_state(ctx.global_state)
    assert torch.equal(state["classifier.weight"], creff.weight)
    assert torch.equal(state["extractor.weight"], ctx.global_state["extractor.weight"])


def test_state_dict_round_trip_gives_identical_continuation(make_context):
    ctx = make_context()
    a = CReFF(PARAMS, num_classes=3, feature_dim=4)
    _round(a, ctx, 1)
    saved = {k: v.clone() for k, v in a.state_dict().items()}
    assert set(saved) == {"features", "momentum", "weight", "bias"}
    _round(a, ctx, 2)
    b = CReFF(PARAMS, num_classes=3, feature_dim=4)
    b.load_state_dict(saved)
    _round(b, ctx, 2)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    # and the state really moved between rounds
    assert not torch.equal(saved["features"], a.state_dict()["features"])


def test_creff_debiases_on_the_synthetic_case(make_context):
    ctx = make_context()
    creff = CReFF(CReFFParams(features_per_class=10, match_steps=100, retrain_steps=200, dsa="none"),
                  num_classes=3, feature_dim=4)
    before = ctx.evaluate(ctx.global_state)["accuracy"]
    for r in (1, 2, 3):
        _round(creff, ctx, r)
    after = ctx.evaluate(creff.eval_state(ctx.global_state))["accuracy"]
    assert after > before + 0.2, (before, after)
    assert np.isfinite(creff.features.numpy()).all()


def test_creff_with_clsnorm_head(make_context):
    ctx = make_context(normalized=True)
    creff = CReFF(CReFFParams(features_per_class=10, match_steps=50, retrain_steps=200, dsa="none"),
                  num_classes=3, feature_dim=4)
    before = ctx.evaluate(ctx.global_state)["accuracy"]
    for r in (1, 2):
        _round(creff, ctx, r)
    state = creff.eval_state(ctx.global_state)
    assert set(state) == set(ctx.global_state)
    assert ctx.evaluate(state)["accuracy"] > before + 0.2
    # a clsnorm head stays bias-free: exactly the stored zero, nothing trained or stored
    assert torch.equal(state["classifier.bias"], torch.zeros(3))
    assert creff.bias is None and "bias" not in creff.state_dict()


def test_matching_loss_bias_term_hand_value():
    # d = 2, C = 2; class 0 only (mask). Rows [dW | db]:
    g_fed = torch.zeros(2, 2, 3)
    g_agg = torch.ones(2, 2, 3)
    g_fed[0] = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    g_agg[0] = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    mask = torch.tensor([True, False])
    # "term": weight rows cos 1 and 0 -> 0 + 1; bias vectors (1, 0) vs (0, 1): cos 0 -> 1
    assert matching_loss(g_fed, g_agg, mask, "sum", "term").item() == pytest.approx(2.0)
    assert matching_loss(g_fed, g_agg, mask, "mean", "term").item() == pytest.approx(1.0)
    # "rows": (1,0,1).(1,0,0) -> cos 1/sqrt 2; (0,1,0).(1,0,1) -> cos 0
    assert matching_loss(g_fed, g_agg, mask, "sum", "rows").item() == pytest.approx(2 - 2 ** -0.5)
    # bias-free head: the weight rows alone, in either mode
    for mode in ("term", "rows"):
        assert matching_loss(g_fed, g_agg, mask, "sum", mode, has_bias=False).item() == pytest.approx(1.0)


def test_bias_term_matching_gradient_equals_autograd():
    c, m, d = 3, 4, 5
    s = _rand(c, m, d, seed=11).requires_grad_()
    w, b = _rand(c, d, seed=12), _rand(c, seed=13)
    target = _rand(c, c, d + 1, seed=14)
    mask = torch.tensor([True, True, False])
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = []
    for k in range(c):
        loss = F.cross_entropy(s[k] @ wl.T + bl, torch.full((m,), k))
        gw, gb = torch.autograd.grad(loss, (wl, bl), create_graph=True)
        ref.append((gw, gb))
    # the authors' loss written out: per class, sum_j (1 - cos(dW_j)) + (1 - cos(db))
    by_hand = sum(
        (1 - F.cosine_similarity(gw, target[k, :, :d], dim=1)).sum()
        + (1 - F.cosine_similarity(gb, target[k, :, d], dim=0))
        for k, (gw, gb) in enumerate(ref) if mask[k])
    ours = matching_loss(class_mean_grads(s, w, b), target, mask, "sum", "term")
    torch.testing.assert_close(ours, by_hand)
    torch.testing.assert_close(torch.autograd.grad(ours, s)[0], torch.autograd.grad(by_hand, s)[0])


def test_capped_per_class_draws():
    y = torch.tensor([0, 1, 0, 0, 1, 0, 0, 2])          # class 0: 5 samples, 1: 2, 2: 1
    x = _rand(8, 5, seed=3)
    assert capped_per_class(x, y, 3, 5, seed=0) is None   # nobody above the cap: all samples
    hits = torch.zeros(8)
    for seed in range(2000):
        keep = capped_per_class(x, y, 3, 3, seed)
        assert torch.equal(keep, torch.sort(keep).values) and len(keep.unique()) == len(keep)
        assert torch.bincount(y[keep], minlength=3).tolist() == [3, 2, 1]
        hits[keep] += 1
    # uniform without replacement over seeds: each class-0 sample kept with probability 3/5
    freq = hits / 2000
    assert torch.allclose(freq[y == 0], torch.full((5,), 0.6), atol=0.05)
    assert torch.equal(freq[y != 0], torch.ones(3))


def test_content_keys_follow_the_sample_not_its_position():
    x = _rand(10, 4, seed=5)
    keys = content_keys(x, seed=7)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(content_keys(x[perm], seed=7), keys[perm])
    assert torch.equal(content_keys(x[1:], seed=7), keys[1:])
    assert len(keys.unique()) == 10 and not torch.equal(content_keys(x, seed=8), keys)
    for dtype in (torch.float32, torch.float16, torch.uint8):  # every storage the data has
        k = content_keys((x * 10).abs().to(dtype), seed=7)
        assert torch.equal(content_keys((x[2:] * 10).abs().to(dtype), seed=7), k[2:])


def test_content_keys_are_exact_on_cifar_sized_rows():
    """Removing one sample leaves every other key unchanged bit for bit, on rows as long as a
    CIFAR image (a float random projection failed this: BLAS sums the rows of matrices of
    different heights in different orders, and a key that moves can reorder the draw)."""
    x = torch.rand(303, 3072, generator=torch.Generator().manual_seed(0))
    keys = content_keys(x, seed=5)
    for i in range(0, 303, 29):
        keep = torch.arange(303) != i
        assert torch.equal(content_keys(x[keep], seed=5), keys[keep])


@pytest.mark.parametrize("weighting", ["sample", "client"])
@pytest.mark.parametrize("cap", [1, 4, 6, None])
def test_release_moves_by_at_most_the_clip_when_one_example_is_removed(weighting, cap, helpers):
    """The sensitivity the DP noise is calibrated to (G, ``ReleaseSpec`` "grad"): removing
    each example in turn moves the released class gradients by at most G in L2, with a cap
    that binds (class 0 holds 14 samples) or without one. With the positional draw the cap
    had before, one removal re-drew the whole class and moved a sum by many G. The features
    are 8-d and spread out, so that per-sample gradients point in different directions and a
    re-drawn subset really moves the sum: with the positional draw (halved or not) the
    sample-weighted caps 1, 4 and 6 and the client-weighted cap 1 fail, and so does the
    content draw without the halving."""
    from privfedcal.privacy.dp import L2Clip

    clip = 0.3
    model = helpers.TinyModel(8, 3).eval()
    x = _rand(20, 8, seed=31).float() * 4
    y = torch.tensor([0] * 14 + [1] * 4 + [2] * 2)
    w, b = _rand(3, 8, seed=32).float(), _rand(3, seed=33).float()
    bound = L2Clip({"feature": 10.0, "class-gradient": clip})
    task = GradTask(w, b, 3, weighting, per_class_cap=cap, seed=5)
    base = task.compute(model, x, y, bound)["grad"].double()
    worst = 0.0
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        moved = task.compute(model, x[keep], y[keep], bound)["grad"].double() - base
        worst = max(worst, float(moved.norm()))
    assert worst <= clip * (1 + 1e-6)
    assert worst > 0.1 * clip  # the check is not vacuous: removals do move the release


def test_grad_task_with_cap_equals_the_task_on_the_drawn_subset(helpers):
    model = helpers.TinyModel(3, 3).eval()
    x = _rand(40, 3, seed=21).float()
    y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(2))
    w, b = _rand(3, 3, seed=22).float(), _rand(3, seed=23).float()
    keep = capped_per_class(x, y, 3, 4, seed=9)
    assert keep is not None and len(keep) == 12
    for weighting in ("client", "sample"):
        capped = GradTask(w, b, 3, weighting, per_class_cap=4, seed=9).compute(model, x, y, NoBound())
        subset = GradTask(w, b, 3, weighting).compute(model, x[keep], y[keep], NoBound())
        half = 0.5 if weighting == "sample" else 1.0  # capped sums are halved (sensitivity)
        for k in capped:
            torch.testing.assert_close(capped[k], subset[k] * (half if k == "grad" else 1.0))


def test_retrain_step_count_and_initial_head(make_context):
    p = CReFFParams()
    assert (p.retrain_lr, p.retrain_batch_size, p.retrain_unit) == (0.01, 32, "epoch")
    assert p.num_retrain_steps(1000) == 300 * 32          # 300 epochs of ceil(1000/32) batches
    assert CReFFParams(retrain_unit="step").num_retrain_steps(1000) == 300
    assert CReFFParams(retrain_batch_size=None).num_retrain_steps(1000) == 300
    seen = {}
    for init in ("fresh", "global"):
        ctx = make_context()
        creff = CReFF(CReFFParams(features_per_class=4, match_steps=1, retrain_steps=1,
                                  initial_head=init, dsa="none"), num_classes=3, feature_dim=4)
        tasks: list = []

        def recording(task, *a, _tasks=tasks, _collect=ctx.collect, **k):
            _tasks.append(task)
            return _collect(task, *a, **k)

        ctx.collect = recording
        creff.after_round(ctx)
        seen[init] = tasks[0]
    glob = make_context().global_state
    assert torch.equal(seen["global"].weight, glob["classifier.weight"])
    fresh = seen["fresh"].weight
    assert not torch.equal(fresh, glob["classifier.weight"]) and fresh.abs().max() <= 0.5  # 1/sqrt(4)
    with pytest.raises(UsageError, match="bias match"):
        CReFFParams(bias_match="none")


def test_client_draws_change_nothing_where_no_class_exceeds_the_cap(make_context):
    # the synthetic clients hold at most 60 samples of a class: a cap of 10 x 32 never binds,
    # so the run is bit-identical to one over all samples (the draw's seed consumes nothing)
    runs = []
    for draws in (10, None):
        ctx = make_context()
        creff = CReFF(CReFFParams(features_per_class=6, match_steps=5, retrain_steps=3,
                                  client_draws=draws, dsa="none"), num_classes=3, feature_dim=4)
        for r in (1, 2):
            _round(creff, ctx, r)
        runs.append(creff.state_dict())
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_privacy_policy_sample_weighting_under_dp_unless_given():
    """CReFF's own policy (read by the planner): under DP the weighting defaults to sample
    with a note; a given client weighting is kept, with a warning; without DP, nothing."""
    from privfedcal.calibration.creff import CReFF
    from privfedcal.settings.run_config import RunConfig

    dp = PrivacyOptions.of(RunConfig.of(method="creff", dp_eps=8.0))
    schedule = {"rounds": 30, "creff_client_draws": DP_CLIENT_DRAWS}
    assert CReFF.privacy_options(dp, {"seed": 0}) == {"seed": 0, "creff_weighting": "sample",
                                                      **schedule}
    assert "uses sample weighting" in CReFF.privacy_hints(dp)[0]
    given = dataclasses.replace(dp, calibration_params={"creff_weighting": "client"})
    assert CReFF.privacy_options(given, {"creff_weighting": "client"}) == {
        "creff_weighting": "client", **schedule}
    assert "far more accurate" in CReFF.privacy_hints(given)[0]
    sample = dataclasses.replace(dp, calibration_params={"creff_weighting": "sample"})
    assert CReFF.privacy_hints(sample) == []
    plain = PrivacyOptions.of(RunConfig.of(method="creff"))
    assert CReFF.privacy_options(plain, {}) == {"rounds": 30}
    assert CReFF.privacy_hints(plain) == []


def test_release_schedule_is_the_last_rounds_of_the_public_config():
    """The rounds CReFF releases in: the last --creff-release-last rounds (every round by
    default, with or without DP), from the public config alone."""
    from privfedcal.settings.run_config import RunConfig

    assert release_schedule(30, 10) == tuple(range(21, 31))
    assert release_schedule(30, None) == release_schedule(30, 0) == tuple(range(1, 31))
    assert release_schedule(5, 10) == (1, 2, 3, 4, 5) and release_schedule(0, 3) == ()
    dp = RunConfig.of(method="creff", dp_eps=8.0)
    assert CReFF.release_rounds(PrivacyOptions.of(dp)) == tuple(range(1, 31))
    assert CReFF.release_rounds(PrivacyOptions.of(RunConfig.of(method="creff"))) == tuple(range(1, 31))
    assert CReFF.release_rounds(PrivacyOptions.of(dp.replace(calibration_params={"creff_release_last": 10}))) == \
        tuple(range(21, 31))
    given = dp.replace(calibration_params={"creff_release_last": 4}, rounds=12)
    assert CReFF.release_rounds(PrivacyOptions.of(given)) == (9, 10, 11, 12)
    assert CReFF.release_rounds(PrivacyOptions.of(dp.replace(calibration_params={"creff_release_last": 0}))) == \
        tuple(range(1, 31))
    # nothing private enters: the data seed (the partition) and the noise change nothing
    for other in (given.replace(data_seed=123), given.replace(insecure_seeded_noise=True),
                  given.replace(seed=7)):
        assert CReFF.release_rounds(PrivacyOptions.of(other)) == CReFF.release_rounds(PrivacyOptions.of(given))
    with pytest.raises(UsageError, match="release last"):
        CReFFParams(release_last=-1)


def test_rounds_outside_the_schedule_release_nothing(make_context):
    """A round outside the schedule collects nothing and leaves S and v_hat alone; before
    the first release the run evaluates the global model."""
    ctx = make_context()
    creff = CReFF(CReFFParams(features_per_class=4, match_steps=3, retrain_steps=2, dsa="none",
                              release_last=2, rounds=4), num_classes=3, feature_dim=4)
    assert [r for r in range(1, 5) if creff.releases_in(r)] == [3, 4]
    for r in (1, 2):
        assert _round(creff, ctx, r) == {"name": "creff", "released": False}
    assert ctx.labels == [] and creff.eval_state(ctx.global_state) is ctx.global_state
    _round(creff, ctx, 3)
    _round(creff, ctx, 4)
    assert ctx.labels == ["creff-grad", "creff-grad"]
    # without the run's rounds (a calibrator built by hand) every round releases
    assert CReFF(CReFFParams(release_last=2), num_classes=3).releases_in(1)



def test_under_dp_clients_sum_every_sample_unhalved_unless_a_cap_is_given(tiny_cfg, helpers):
    """DP_CLIENT_DRAWS: under DP the calibrator a run builds has no per-class cap, so the
    sample-weighted sums are not halved (sensitivity G without the swap); a given
    --creff-client-draws is kept, and without DP the authors' 10 draws stay."""
    from privfedcal.experiment import build_calibrator, build_experiment

    dp = tiny_cfg(method="creff", dp_eps=8.0)
    exp = build_experiment(dp)
    assert DP_CLIENT_DRAWS == 0 and build_calibrator(dp, exp).params.client_draws is None
    capped = dp.replace(calibration_params={"creff_client_draws": 10})
    assert build_calibrator(capped, exp).params.client_draws == 10
    assert build_calibrator(tiny_cfg(method="creff"), exp).params.client_draws == 10
    assert CReFFParams(client_draws=0).client_draws is None
    # uncapped sample sums are the plain sums of the clipped per-sample gradients
    model = helpers.TinyModel(4, 3).eval()  # features = x
    x, y = _rand(12, 4, seed=41).float(), torch.tensor([0, 1, 2] * 4)
    w, b = _rand(3, 4, seed=42).float(), _rand(3, seed=43).float()
    out = GradTask(w, b, 3, "sample", per_class_cap=None).compute(model, x, y, NoBound())
    g = per_sample_head_grads(x.double(), y, w.double(), b.double())
    want = torch.zeros(3, 3, 5, dtype=torch.float64).index_add_(0, y, g)
    assert torch.allclose(out["grad"], want, atol=1e-5)
