"""Feature inversion through toy extractors (what statistics pin down: test_feature_targets.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from privfedcal.attacks.reconstruction.feature_inversion import (
    FeatureTarget,
    InversionConfig,
    invert_features,
    total_variation,
)
from privfedcal.attacks.reconstruction.feature_targets import features_from_stats
from privfedcal.attacks.reconstruction.metrics import psnr
from privfedcal.errors import UsageError

MEAN, STD = [0.5], [0.25]
SHAPE = (1, 4, 4)


def _feats(model, pixels):
    with torch.no_grad():
        return model.features((pixels - MEAN[0]) / STD[0])


def _matched_cos(z_rec, z_true):
    """Cosine of each true feature to its recovered partner, under the best pairing."""
    cos = F.cosine_similarity(z_true[:, None], z_rec[None], dim=-1)
    direct, swapped = cos.diagonal(), cos.flip(1).diagonal()
    return direct if direct.sum() >= swapped.sum() else swapped


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


def _invert_unregularised(model, target, *, steps, lr, restarts):
    """``invert_features`` on the 4x4 test images with the priors off (tv and l2 weight 0),
    so that only the feature match drives the reconstruction."""
    return invert_features(model, target, image_shape=SHAPE, mean=MEAN, std=STD,
                           generator=_gen(), steps=steps, lr=lr, restarts=restarts,
                           tv_weight=0.0, l2_weight=0.0)


def test_raw_feature_inversion_through_injective_extractor(linear_model, images):
    z = _feats(linear_model, images[:1])
    res = _invert_unregularised(linear_model, FeatureTarget.raw(z[0]), steps=200, lr=0.1,
                                restarts=2)
    assert res.mode == "raw-feature" and res.images.shape == (1, *SHAPE)
    assert psnr(res.images, images[:1]).item() > 30
    assert res.cosine > 0.9999
    # the returned images really produce the returned features (box respected, no clamp)
    assert torch.allclose(_feats(linear_model, res.images), res.features, atol=1e-5)


def test_stats_attack_recovers_both_features_for_n2(mlp_model, images):
    z = _feats(mlp_model, images[:2])
    mu, cov = z.mean(0), torch.cov(z.T)
    res = _invert_unregularised(mlp_model, FeatureTarget.class_stats(2, mu, cov), steps=200, lr=0.3,
                                restarts=2)
    assert res.mode == "class-stats-features"  # automatic for n = 2
    assert (_matched_cos(res.features, z) > 0.99).all()
    assert torch.allclose(res.target_features.double(), features_from_stats(2, mu, cov).double())


def test_direct_mean_and_covariance_matching_also_pins_n2(mlp_model, images):
    z = _feats(mlp_model, images[:2])
    target = FeatureTarget.class_stats(2, z.mean(0), torch.cov(z.T), mode="direct")
    res = _invert_unregularised(mlp_model, target, steps=200, lr=0.3,
                                restarts=2)
    assert res.mode == "class-stats-direct"
    assert (_matched_cos(res.features, z) > 0.99).all()


def test_mean_only_batch_matches_the_mean_but_not_the_features(mlp_model, images):
    z = _feats(mlp_model, images[:2])
    target = FeatureTarget.class_mean(z.mean(0), 2, batch=True)
    res = _invert_unregularised(mlp_model, target, steps=200, lr=0.3,
                                restarts=2)
    assert res.mode == "class-mean-batch" and res.images.shape == (2, *SHAPE)
    assert res.cosine > 0.999  # the mean is matched ...
    assert _matched_cos(res.features, z).min() < 0.95  # ... the individual features are not


def test_class_mean_single_image_targets_the_mean(linear_model, images):
    z = _feats(linear_model, images)
    res = _invert_unregularised(linear_model, FeatureTarget.class_mean(z.mean(0), 3), steps=150, lr=0.1,
                                restarts=1)
    assert res.mode == "class-mean" and res.images.shape == (1, *SHAPE)
    # a linear extractor maps the mean image to the mean feature
    assert psnr(res.images, images.mean(0, keepdim=True)).item() > 30


def test_bn_prior_runs_and_leaves_the_model_untouched(toy, images):
    model = toy(bn=True)
    model.bn.running_mean.fill_(0.1)
    model.bn.running_var.fill_(0.9)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    z = _feats(model.eval(), images[:1])
    model.train()
    res = invert_features(
        model,
        FeatureTarget.raw(z[0]),
        image_shape=SHAPE,
        mean=MEAN,
        std=STD,
        generator=_gen(),
        steps=5,
        restarts=2,
        bn_weight=1.0,
    )
    assert model.training and not model.bn._forward_hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert res.restart_losses.shape == (2,)


def test_same_seed_same_images_and_best_restart_kept(linear_model, images):
    z = _feats(linear_model, images[:1])[0]
    kw = dict(image_shape=SHAPE, mean=MEAN, std=STD, steps=20, restarts=3)
    a = invert_features(linear_model, FeatureTarget.raw(z), generator=_gen(3), **kw)
    b = invert_features(linear_model, FeatureTarget.raw(z), generator=_gen(3), **kw)
    assert torch.equal(a.images, b.images)
    assert a.loss == pytest.approx(float(a.restart_losses.min()))


def test_total_variation_hand_value():
    x = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]])  # vertical diffs 0, horizontal diffs 1
    assert total_variation(x).item() == pytest.approx(1.0)


def test_validation_errors():
    with pytest.raises(UsageError):
        FeatureTarget("pixels", z=torch.zeros(3))
    with pytest.raises(UsageError):
        FeatureTarget.class_stats(2, torch.zeros(3), torch.zeros(2, 2))
    with pytest.raises(UsageError):
        FeatureTarget.class_stats(2, torch.zeros(3), torch.zeros(3, 3), mode="magic")
    with pytest.raises(UsageError):
        InversionConfig(lr=0.0)
    with pytest.raises(UsageError):
        InversionConfig(restarts=0)
    with pytest.raises(UsageError):
        InversionConfig(tv_weight=-1e-3)


def test_default_priors_by_image_size():
    """Digits (8x8) keep TV 1e-3 and no jitter; 32x32 colour images get TV 0.3 and no
    jitter (the CIFAR-10 strength check); set values win at every size."""
    cfg = InversionConfig()
    assert cfg.jitter_for(8, 8) == 0 and cfg.jitter_for(32, 32) == 0
    assert cfg.tv_for(8, 8) == 1e-3 and cfg.tv_for(15, 32) == 1e-3
    assert cfg.tv_for(16, 16) == 0.3 and cfg.tv_for(32, 32) == 0.3
    set_ = InversionConfig(tv_weight=0.05, jitter=3)
    assert set_.tv_for(32, 32) == 0.05 and set_.tv_for(8, 8) == 0.05
    assert set_.jitter_for(32, 32) == 3
    assert InversionConfig(tv_weight=0.0).tv_for(32, 32) == 0.0


def test_default_tv_is_the_size_rule_in_the_objective():
    """The objective uses the size rule: on a 16x16 image the default config gives the same
    reconstruction as tv_weight=0.3 set explicitly and a different one from 1e-3."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 8))
    model.features = model.forward  # type: ignore[attr-defined]
    z = torch.randn(1, 8)
    kw = dict(image_shape=(1, 16, 16), mean=MEAN, std=STD, steps=30, restarts=1)
    default = invert_features(model, FeatureTarget.raw(z), generator=_gen(2), **kw)
    heavy = invert_features(model, FeatureTarget.raw(z), generator=_gen(2), tv_weight=0.3, **kw)
    light = invert_features(model, FeatureTarget.raw(z), generator=_gen(2), tv_weight=1e-3,
                            **kw)
    assert torch.equal(default.images, heavy.images)
    assert not torch.allclose(default.images, light.images, atol=1e-4)


def test_init_scale_sets_the_start_and_one_keeps_the_uniform_draw(linear_model, images):
    """With no steps the result is the start: init_scale s draws 0.5 + s (u - 0.5) from the
    same uniform u the default draws (s = 1 is that u bit for bit)."""
    z = _feats(linear_model, images[:1])[0]
    kw = dict(image_shape=SHAPE, mean=MEAN, std=STD, steps=0, restarts=1)
    u = torch.rand(1, *SHAPE, generator=_gen(5))
    plain = invert_features(linear_model, FeatureTarget.raw(z), generator=_gen(5), **kw)
    one = invert_features(linear_model, FeatureTarget.raw(z), generator=_gen(5),
                          init_scale=1.0, **kw)
    small = invert_features(linear_model, FeatureTarget.raw(z), generator=_gen(5),
                            init_scale=0.2, **kw)
    # pixels pass through normalise / denormalise: equal up to float rounding
    assert torch.allclose(plain.images, u, atol=1e-6)
    assert torch.equal(one.images, plain.images)
    assert torch.allclose(small.images, 0.5 + 0.2 * (u - 0.5), atol=1e-6)
    assert float(small.images.min()) >= 0.4 - 1e-6 and float(small.images.max()) <= 0.6 + 1e-6
    for bad in (-0.1, 1.5):
        with pytest.raises(UsageError):
            InversionConfig(init_scale=bad)
