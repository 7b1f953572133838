"""Models: shapes, the features/classifier split, the CNN's size, registry errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from privfedcal.algorithms import create_algorithm
from privfedcal.errors import UsageError
from privfedcal.models import MODELS, FeatureClassifier, create_model

torch.set_num_threads(1)

# name -> (in_channels, natural image size, feature dim)
NATURAL = {
    "cnn": (3, 32, 256),
    "digits-cnn": (1, 8, 128),
    "mlp": (1, 8, 128),
    "resnet8": (3, 32, 256),
    "resnet18": (3, 32, 512),
    "resnet18-plain": (3, 32, 512),
    "mobilenetv2": (3, 32, 1280),
    "uv-cnn": (3, 32, 256),
}


def _build(name: str, num_classes: int = 7, seed: int = 0) -> FeatureClassifier:
    ch, size, _ = NATURAL[name]
    return create_model(
        name,
        num_classes=num_classes,
        in_channels=ch,
        image_size=size,
        generator=torch.Generator().manual_seed(seed),
    )


def test_every_registered_model_is_covered() -> None:
    assert sorted(NATURAL) == MODELS.names()


@pytest.mark.parametrize("name", sorted(NATURAL))
def test_shapes_and_split(name: str) -> None:
    ch, size, dim = NATURAL[name]
    model = _build(name).eval()
    x = torch.randn(2, ch, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z = model.features(x)
        logits = model(x)
        split = model.classifier(z)
    assert isinstance(model, FeatureClassifier)
    assert z.shape == (2, dim) and model.feature_dim == dim
    assert logits.shape == (2, 7) and model.num_classes == 7
    assert isinstance(model.classifier, torch.nn.Linear)
    assert model.classifier.in_features == dim
    torch.testing.assert_close(split, logits, rtol=0, atol=0)


def test_cnn_parameter_count_by_hand() -> None:
    # conv 3->6 5x5:   3*6*25 + 6     =   456
    # conv 6->16 5x5:  6*16*25 + 16   =  2416
    # fc 400->120:     400*120 + 120  = 48120
    # fc 120->84:      120*84 + 84    = 10164
    # proj 84->84:     84*84 + 84     =  7140
    # fc 84->256:      84*256 + 256   = 21760
    # classifier:      256*10 + 10    =  2570
    expected = 456 + 2416 + 48120 + 10164 + 7140 + 21760 + 2570
    assert expected == 92626
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=32)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_cnn_other_image_size_flatten() -> None:
    # 28x28 grey: (28-4)//2 = 12, (12-4)//2 = 4 -> flatten 16*4*4 = 256
    model = create_model("cnn", num_classes=10, in_channels=1, image_size=28)
    assert model.body[0].in_features == 256
    assert model(torch.zeros(1, 1, 28, 28)).shape == (1, 10)


def test_cnn_too_small_suggests_alternatives() -> None:
    with pytest.raises(UsageError, match="mlp.*digits-cnn"):
        create_model("cnn", num_classes=10, in_channels=1, image_size=8)


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(UsageError) as err:
        create_model("vgg", num_classes=10, in_channels=3, image_size=32)
    for name in MODELS.names():
        assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_classes=1, in_channels=3, image_size=32),
        dict(num_classes=10, in_channels=0, image_size=32),
        dict(num_classes=10, in_channels=3, image_size=2.5),
    ],
)
def test_bad_sizes_are_usage_errors(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        create_model("mlp", **kwargs)


def test_generator_makes_builds_reproducible_and_spares_global_rng() -> None:
    before = torch.random.get_rng_state()
    a, b, c = _build("resnet8", seed=3), _build("resnet8", seed=3), _build("resnet8", seed=4)
    assert torch.equal(torch.random.get_rng_state(), before)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_mobilenet_stem_stride_depends_on_image_size() -> None:
    small = create_model("mobilenetv2", num_classes=10, in_channels=3, image_size=32)
    large = create_model("mobilenetv2", num_classes=10, in_channels=1, image_size=96)
    assert small.body[0][0].stride == (1, 1)
    assert large.body[0][0].stride == (2, 2) and large.body[0][0].in_channels == 1
    assert not any(isinstance(m, torch.nn.Dropout) for m in small.modules())


def test_resnet_structure() -> None:
    r8 = create_model("resnet8", num_classes=10, in_channels=3, image_size=32)
    r18 = create_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    assert len(r8.stages) == 3 and len(r18.stages) == 8
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in r18.modules())
    assert r18.stem[0].kernel_size == (3, 3) and r18.stem[0].stride == (1, 1)
    # resnet8 on 32x32: the last stage works at 8x8 with 256 channels (CReFF's scaling 4)
    with torch.no_grad():
        fmap = r8.stages(r8.stem(torch.zeros(1, 3, 32, 32)))
    assert fmap.shape == (1, 256, 8, 8)


def test_resnet8_parameter_count_by_hand() -> None:
    # CReFF's ResNet_cifar(resnet_size=8, scaling=4), 10 classes (BN: 2 parameters/channel)
    # stem:    conv 3->64 3x3 = 1728,           BN 64 = 128
    # stage 1: conv 64->64 3x3 x2 = 2*36864,    BN 64 x2 = 256              (no shortcut conv)
    # stage 2: conv 64->128 3x3 = 73728, conv 128->128 3x3 = 147456, BN x2 = 512,
    #          shortcut conv 64->128 1x1 = 8192 + BN 256
    # stage 3: conv 128->256 3x3 = 294912, conv 256->256 3x3 = 589824, BN x2 = 1024,
    #          shortcut conv 128->256 1x1 = 32768 + BN 512
    # classifier 256*10 + 10 = 2570
    expected = (1728 + 128 + 2 * 36864 + 256 + 73728 + 147456 + 512 + 8192 + 256
                + 294912 + 589824 + 1024 + 32768 + 512 + 2570)
    assert expected == 1227594
    model = create_model("resnet8", num_classes=10, in_channels=3, image_size=32)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.feature_dim == 256 and model.classifier.in_features == 256


def test_resnet18_projector_is_feduv_and_feeds_z() -> None:
    from privfedcal.algorithms.feduv import uniformity_loss, variance_loss

    r18 = _build("resnet18").train()
    plain = _build("resnet18-plain")
    # projector: Linear 512->512 + BN + ReLU, twice: 2 * (512*512 + 512 + 2*512) parameters
    extra = sum(p.numel() for p in r18.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == 2 * (512 * 512 + 512 + 2 * 512)
    kinds = [type(m).__name__ for m in r18.projector]
    assert kinds == ["Linear", "ProjectorBatchNorm", "ReLU"] * 2
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    with torch.no_grad():
        pooled = r18.pool(r18.stages(r18.stem(x)))
        z = r18.projector(pooled)
        torch.testing.assert_close(r18.features(x), z)
        assert (z >= 0).all() and z.shape == (6, 512)
        # FedUV's L_U acts on the projector output, its classifier reads it
        algo = create_algorithm("feduv", num_classes=7, mu=0.5, lam=1.5)
        logits = r18.classifier(z)
        expected = (F.cross_entropy(logits, y) + 0.5 * uniformity_loss(z)
                    + 1.5 * variance_loss(logits, algo.c))
        torch.testing.assert_close(algo.local_loss(r18, x, y), expected)


def test_uv_cnn_has_feduv_bn_projector_feeding_z() -> None:
    net = _build("uv-cnn").train()
    kinds = [type(m).__name__ for m in net.projector]
    assert kinds == ["Linear", "ProjectorBatchNorm", "ReLU"] * 2
    assert net.projector[0].in_features == 64 and net.projector[0].out_features == 256
    convs = [m for m in net.convs if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size[0], c.stride[0]) for c in convs] == [
        (16, 3, 1), (16, 1, 1), (32, 3, 2), (32, 3, 1), (32, 1, 1), (64, 3, 2), (64, 3, 1),
        (64, 1, 1)]
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        z = net.projector(net.convs(x))
        torch.testing.assert_close(net.features(x), z)
        assert (z >= 0).all()
    with pytest.raises(UsageError):
        create_model("uv-cnn", num_classes=3, in_channels=1, image_size=8)


@pytest.mark.parametrize("name", ["uv-cnn", "resnet18"])
def test_projector_trains_on_a_batch_of_one(name: str) -> None:
    # a one-sample client: BatchNorm1d would raise; the projector uses its running statistics
    net = _build(name).train()
    ch, size, _ = NATURAL[name]
    x = torch.randn(3, ch, size, size, generator=torch.Generator().manual_seed(4))
    net(x[:2])  # one ordinary step moves the running statistics off their initial values
    bn = net.projector[1]
    assert isinstance(bn, torch.nn.BatchNorm1d)
    before = bn.running_mean.clone()
    out = net(x[2:])
    torch.testing.assert_close(bn.running_mean, before, rtol=0, atol=0)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)
    # the projector's value on the row equals the eval-mode projector (running statistics)
    h = net.convs(x[2:]) if name == "uv-cnn" else net.pool(net.stages(net.stem(x[2:])))
    train_z = net.projector(h)
    net.projector.eval()
    torch.testing.assert_close(train_z, net.projector(h))
