"""MOON: l_con against the formula, z_glob / z_prev from the stored states, BN left intact."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.algorithms import create_algorithm
from privfedcal.algorithms.moon import moon_contrastive_loss
from privfedcal.errors import UsageError
from privfedcal.models import create_model


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), tau=st.floats(0.05, 2.0), n=st.integers(1, 5))
def test_l_con_matches_formula(seed: int, tau: float, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    z, zg, zp = (torch.randn(n, 6, generator=g, dtype=torch.float64) for _ in range(3))
    got = moon_contrastive_loss(z, zg, zp, tau)
    sims = torch.stack([F.cosine_similarity(z, zg, dim=1), F.cosine_similarity(z, zp, dim=1)])
    ref = F.cross_entropy(sims.T / tau, torch.zeros(n, dtype=torch.long))
    torch.testing.assert_close(got, ref)
    # -log( e^{s_g/tau} / (e^{s_g/tau} + e^{s_p/tau}) ), averaged over the batch, in numpy
    sg, sp = _cos(z.numpy(), zg.numpy()) / tau, _cos(z.numpy(), zp.numpy()) / tau
    by_hand = np.mean(-np.log(np.exp(sg) / (np.exp(sg) + np.exp(sp))))
    assert got.item() == pytest.approx(by_hand, rel=1e-9)


def test_first_visit_reports_no_contrastive_term(mlp, batch, perturb) -> None:
    # Without a previous model z_prev would be z_glob: l_con = log 2 for any z, gradient 0.
    # The loss is CE alone (l_con reported as 0), also away from the global weights.
    x, y = batch
    algo = create_algorithm("moon", num_classes=3, mu=5.0)
    glob = {k: v.clone() for k, v in mlp.state_dict().items()}
    perturb(mlp)
    algo.begin_client(mlp, glob, None)
    ce = F.cross_entropy(mlp(x), y).item()
    assert algo.local_loss(mlp, x, y).item() == pytest.approx(ce, rel=1e-9)
    # the constant it replaces: MOON's loss with z_prev = z_glob is CE + mu * log 2
    z = mlp.features(x)
    zg = algo._frozen_features(algo._glob, x)
    assert moon_contrastive_loss(z, zg, zg, 0.5).item() == pytest.approx(math.log(2), rel=1e-6)


def test_uses_stored_global_and_previous_states(make_mlp, batch, perturb) -> None:
    x, y = batch
    live, glob_model, prev_model = make_mlp(0), make_mlp(1), make_mlp(2)
    algo = create_algorithm("moon", num_classes=3, tau=0.7, mu=2.0)
    live.load_state_dict(glob_model.state_dict())
    algo.begin_client(live, glob_model.state_dict(), prev_model.state_dict())
    perturb(live, seed=9)  # as if some local steps had been taken
    with torch.no_grad():
        z, zg, zp = live.features(x), glob_model.features(x), prev_model.features(x)
        expected = F.cross_entropy(live(x), y) + 2.0 * moon_contrastive_loss(z, zg, zp, 0.7)
    torch.testing.assert_close(algo.local_loss(live, x, y), expected)


def test_batchnorm_buffers_and_states_untouched(tiny_bn) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    prev = {
        k: v + 0.5 if v.is_floating_point() else v.clone() for k, v in tiny_bn.state_dict().items()
    }
    glob = copy.deepcopy(tiny_bn.state_dict())
    glob_before, prev_before = copy.deepcopy(glob), copy.deepcopy(prev)
    reference = copy.deepcopy(tiny_bn)
    algo = create_algorithm("moon", num_classes=3)
    tiny_bn.train()
    algo.begin_client(tiny_bn, glob, prev)
    algo.local_loss(tiny_bn, x, y).backward()
    reference.train()
    reference(x)  # one plain training forward: what the live BN buffers should have seen
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(tiny_bn.state_dict()[key], value)
    for stored, before in ((glob, glob_before), (prev, prev_before)):
        for key in before:
            assert torch.equal(stored[key], before[key])
    assert tiny_bn.training
    # z_glob / z_prev use eval-mode BN with the stored running statistics
    frozen = copy.deepcopy(reference)
    frozen.load_state_dict(prev_before)
    frozen.eval()
    with torch.no_grad():
        torch.testing.assert_close(algo._frozen_features(algo._prev, x), frozen.features(x))


def test_end_client_returns_detached_clone(mlp) -> None:
    algo = create_algorithm("moon", num_classes=3)
    algo.begin_client(mlp, mlp.state_dict(), None)
    state = algo.end_client(mlp)
    before = state["classifier.weight"].clone()
    with torch.no_grad():
        mlp.classifier.weight.add_(1.0)
    assert torch.equal(state["classifier.weight"], before)
    assert not state["classifier.weight"].requires_grad


@pytest.mark.parametrize("kwargs", [dict(tau=0.0), dict(mu=-1.0)])
def test_bad_params(kwargs) -> None:
    with pytest.raises(UsageError):
        create_algorithm("moon", num_classes=3, **kwargs)


@pytest.mark.parametrize("model_name", ["tiny_bn", "cnn"])
def test_autocast_precast_frozen_states_equal_per_step_casting(model_name, tiny_bn) -> None:
    """Under autocast the frozen models' linear/conv entries are cast once per client; the
    features equal autocast's own per-call casting of the fp32 states, bit for bit, and the
    normalisation entries stay fp32 (casting them would change BatchNorm's arithmetic)."""
    if model_name == "cnn":
        live = create_model("cnn", num_classes=3, in_channels=3, image_size=16,
                            generator=torch.Generator().manual_seed(0))
        x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    else:
        live = tiny_bn
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    glob = {k: v.clone() for k, v in live.state_dict().items()}
    prev = {k: v + 0.25 if v.is_floating_point() else v.clone() for k, v in glob.items()}
    algo = create_algorithm("moon", num_classes=3, mu=1.0)
    live.train()
    algo.begin_client(live, glob, prev)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast_glob, fast_prev = algo._frozen_states("cpu")
        z_glob = algo._frozen_features(fast_glob, x)
        z_prev = algo._frozen_features(fast_prev, x)
        ref_glob = algo._frozen_features(algo._glob, x)   # fp32 states, cast by autocast
        ref_prev = algo._frozen_features(algo._prev, x)
        again = algo._frozen_states("cpu")
    assert again[0] is fast_glob                            # cast once per client
    assert torch.equal(z_glob, ref_glob) and torch.equal(z_prev, ref_prev)
    cast = {k for k, v in fast_glob.items() if v.dtype == torch.bfloat16}
    assert cast and all(".weight" in k or ".bias" in k for k in cast)
    assert not any("running" in k for k in cast)
    if model_name == "tiny_bn":
        assert fast_glob["model.body.1.weight"].dtype == torch.float32   # BatchNorm's affine
    assert algo._frozen_states("cpu")[0] is algo._glob     # outside autocast: as stored
