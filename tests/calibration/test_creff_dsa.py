"""CReFF's client gradients under DSA (privfedcal/data/dsa.py): which images share a
transform, that a sample's transform ignores the other samples, and that the release keeps
the sensitivity its noise is calibrated to with augmentation on."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from privfedcal.calibration.creff import CReFFParams, GradTask, content_keys
from privfedcal.data.dsa import AUTHORS_STRATEGY
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.bound import NoBound
from privfedcal.privacy.dp import L2Clip

torch.set_num_threads(1)
PRIME = 2**31 - 1


class ImageModel(FeatureClassifier):
    """features = a fixed random linear map of the flattened image, then a linear head."""

    def __init__(self, shape=(1, 6, 6), dim: int = 8, num_classes: int = 3) -> None:
        super().__init__()
        self.feature_dim, self.num_classes = dim, num_classes
        g = torch.Generator().manual_seed(11)
        self.extractor = nn.Linear(int(torch.tensor(shape).prod()), dim, bias=False)
        with torch.no_grad():
            self.extractor.weight.copy_(torch.randn(self.extractor.weight.shape, generator=g))
        self.classifier = nn.Linear(dim, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.extractor(x.flatten(1))


def data(n_per_class=(14, 4, 2), seed=0):
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(n_per_class)])
    x = torch.randn(len(y), 1, 6, 6, generator=torch.Generator().manual_seed(seed))
    return x, y


def head(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 8, generator=g), torch.randn(3, generator=g)


def test_default_is_the_authors_strategy():
    assert CReFFParams().dsa == AUTHORS_STRATEGY == "color_crop_cutout_flip_scale_rotate"


def test_a_samples_transform_ignores_the_other_samples():
    """Removing one sample leaves every other sample's augmented image unchanged bit for bit:
    the DP sensitivity argument needs each sample's transform to be its own."""
    x, y = data()
    task = GradTask(*head(), 3, dsa=AUTHORS_STRATEGY, seed=5, dsa_groups=4)
    keys = content_keys(x, 5)
    out = task.augment(x, y, keys)
    assert not torch.equal(out, x)
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        assert torch.equal(task.augment(x[keep], y[keep], keys[keep]), out[keep])


def test_samples_of_a_class_group_share_one_transform():
    """Siamese within a (class, group), as the authors' class batches: give sample j sample
    i's image but keep j's key, and j's output becomes i's output exactly; two groups of a
    class get different transforms."""
    x, y = data(seed=4)
    groups = 3
    task = GradTask(*head(), 3, dsa=AUTHORS_STRATEGY, seed=9, dsa_groups=groups)
    keys = content_keys(x, 9)
    group = (keys % PRIME) % groups
    out = task.augment(x, y, keys)
    pairs = [(i, j) for i in range(14) for j in range(i + 1, 14) if group[i] == group[j]]
    others = [(i, j) for i in range(14) for j in range(i + 1, 14) if group[i] != group[j]]
    assert pairs and others
    for i, j in pairs:
        x2 = x.clone()
        x2[j] = x[i]
        assert torch.equal(task.augment(x2, y, keys)[j], out[i])
    differ = 0
    for i, j in others:
        x2 = x.clone()
        x2[j] = x[i]
        differ += not torch.equal(task.augment(x2, y, keys)[j], out[i])
    assert differ > 0


def test_the_gradients_are_those_of_the_augmented_images():
    x, y = data(seed=6)
    w, b = head()
    model = ImageModel().eval()
    task = GradTask(w, b, 3, "sample", dsa=AUTHORS_STRATEGY, seed=2, dsa_groups=2)
    plain = GradTask(w, b, 3, "sample")
    augmented = task.augment(x, y, content_keys(x, 2))
    got = task.compute(model, x, y, NoBound())
    want = plain.compute(model, augmented, y, NoBound())
    for k in got:
        torch.testing.assert_close(got[k], want[k])
    assert not torch.allclose(got["grad"], plain.compute(model, x, y, NoBound())["grad"])


@pytest.mark.parametrize("weighting", ["sample", "client"])
@pytest.mark.parametrize("cap", [1, 4, None])
def test_release_under_dsa_moves_by_at_most_the_clip(weighting, cap):
    """With augmentation on, removing each example in turn moves the released class
    gradients by at most G (the sensitivity the noise is calibrated to)."""
    clip = 0.3
    x, y = data(seed=8)
    x = x * 3
    model = ImageModel().eval()
    bound = L2Clip({"feature": 10.0, "class-gradient": clip})
    task = GradTask(*head(5), 3, weighting, per_class_cap=cap, seed=7,
                    dsa=AUTHORS_STRATEGY, dsa_groups=3)
    base = task.compute(model, x, y, bound)["grad"].double()
    worst = 0.0
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        moved = task.compute(model, x[keep], y[keep], bound)["grad"].double() - base
        worst = max(worst, float(moved.norm()))
    assert 0.1 * clip < worst <= clip * (1 + 1e-6)


def test_a_client_without_samples_uploads_zeros_under_dsa():
    task = GradTask(*head(), 3, "sample", per_class_cap=4, dsa=AUTHORS_STRATEGY)
    out = task.compute(ImageModel().eval(), torch.zeros(0, 1, 6, 6), torch.zeros(0, dtype=torch.long),
                       NoBound())
    assert out["grad"].shape == (3, 3, 9) and not out["grad"].any() and not out["count"].any()
