"""privfedcal.api.ownloop: CCVR's client statistics, their DP release and the server's head
re-training, on privfedcal's models and on a user's own module whose head is a Linear.

Formulas are pinned on numpy and opacus called directly; every input check is pinned by its
one-line message; a hypothesis property: statistics over a DataLoader of any batch size are
those over the whole tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import privfedcal
from privfedcal.api.ownloop import calibrate_head, ccvr_statistics, privatize_statistics
from privfedcal.errors import UsageError


class Net(nn.Module):
    """Flower's quickstart shape: a small CNN whose head is ``fc3`` (no ``features()``)."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc1 = nn.Linear(2 * 6 * 6, 5)
        self.fc3 = nn.Linear(5, classes)

    def body(self, x):  # the head's input, computed independently of any hook
        return torch.relu(self.fc1(torch.flatten(torch.relu(self.conv(x)), 1)))

    def forward(self, x):
        return self.fc3(self.body(x))


def numpy_stats(z: np.ndarray, y: np.ndarray, classes: int) -> dict[str, np.ndarray]:
    return {"count": np.array([(y == c).sum() for c in range(classes)], dtype=float),
            "sum": np.stack([z[y == c].sum(0) for c in range(classes)]),
            "outer": np.stack([z[y == c].T @ z[y == c] for c in range(classes)])}


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(30, 1, 8, 8, generator=g), torch.randint(0, 3, (30,), generator=g)


# ---- ccvr_statistics ---------------------------------------------------------------------
def test_ccvr_statistics_match_numpy_and_clip():
    """privfedcal's own model: sums over features recomputed with numpy, and clipped rows
    have norm <= clip."""
    from privfedcal.models import create_model

    torch.manual_seed(0)
    model = create_model("mlp", num_classes=3, in_channels=1, image_size=8).eval()
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 3, (40,))
    with torch.no_grad():
        z = model.features(x).double().numpy()
    stats = privfedcal.ccvr_statistics(model, x, y, 3)
    want = numpy_stats(z, y.numpy(), 3)
    for key in want:
        np.testing.assert_allclose(stats[key].numpy(), want[key], rtol=1e-9)
    clip = float(np.linalg.norm(z, axis=1).min()) / 2  # every row is clipped
    clipped = privfedcal.ccvr_statistics(model, x, y, 3, clip=clip)
    # each row has norm clip, so the trace of outer is count * clip^2, to the precision of
    # the float32 features the rows are scaled in (a relative 1.4e-7 was seen: rtol 1e-6)
    traces = torch.diagonal(clipped["outer"], dim1=1, dim2=2).sum(1)
    torch.testing.assert_close(traces, clipped["count"] * clip * clip, rtol=1e-6, atol=0.0)


def test_a_users_model_is_read_at_its_heads_input(net, data):
    x, y = data
    net.train()
    stats = ccvr_statistics(net, x, y, head="fc3")  # num_classes: the head's 3 outputs
    assert net.training  # the caller's mode is restored
    net.eval()
    with torch.no_grad():
        z = net.body(x).double().numpy()
    want = numpy_stats(z, y.numpy(), 3)
    for key in want:
        assert stats[key].dtype == torch.float64
        np.testing.assert_allclose(stats[key].numpy(), want[key], rtol=1e-9, atol=1e-12)
    found = ccvr_statistics(net, x, y)  # the head found: the last Linear
    assert all(torch.equal(found[k], stats[k]) for k in stats)
    assert list(net.state_dict()) == ["conv.weight", "conv.bias", "fc1.weight", "fc1.bias",
                                      "fc3.weight", "fc3.bias"]  # nothing renamed


def test_a_dataset_and_a_loader_of_mappings_give_the_same_statistics(net, data):
    x, y = data
    whole = ccvr_statistics(net, x, y, 3)
    as_dataset = ccvr_statistics(net, TensorDataset(x, y), num_classes=3, batch_size=7)

    class Pictures(Dataset):  # Flower Datasets' style: one mapping per sample
        def __len__(self):
            return len(y)

        def __getitem__(self, i):
            return {"picture": x[i], "digit": y[i]}

    loader = DataLoader(Pictures(), batch_size=4)
    as_mappings = ccvr_statistics(net, loader, batch_keys=("picture", "digit"))
    # the features are float32, whose kernels round differently per batch size (a relative
    # 3e-7 was seen): rtol 1e-5; a lost or repeated sample moves the sums by far more
    for key in whole:
        torch.testing.assert_close(as_dataset[key], whole[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(as_mappings[key], whole[key], rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 25), batch=st.integers(1, 30), seed=st.integers(0, 2**16),
       clip=st.sampled_from([None, 0.5]))
def test_statistics_over_a_loader_equal_those_over_the_tensors(n, batch, seed, clip):
    torch.manual_seed(seed)
    model = Net(classes=4)
    x, y = torch.randn(n, 1, 8, 8), torch.randint(0, 4, (n,))
    whole = ccvr_statistics(model, x, y, 4, clip=clip)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    batched = ccvr_statistics(model, loader, clip=clip)
    for key in whole:  # float32 features: tolerance as in the test above
        torch.testing.assert_close(batched[key], whole[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("args", "kwargs", "needle"), [
    (lambda x, y: (x.long(), y), {}, "x must be a floating-point tensor, got torch.int64"),
    (lambda x, y: (x[0, 0, 0], y), {}, "x must hold one sample per row"),
    (lambda x, y: (x.index_fill(0, torch.tensor([3]), math.nan), y), {},
     "x has NaN or Inf values"),
    (lambda x, y: (x, None), {}, "y is needed when x is a tensor"),
    (lambda x, y: (x, y.float()), {}, "y must be a 1-d tensor of integer class labels"),
    (lambda x, y: (x, y[:, None]), {}, "y must be a 1-d tensor of integer class labels"),
    (lambda x, y: (x, y[:5]), {}, "y has 5 labels for x's 30 samples"),
    (lambda x, y: (x, y + 1), {}, "y must be in 0..2 (num_classes=3), got 1..3"),
    (lambda x, y: (x, y - 1), {}, "y must be in 0..2"),
    (lambda x, y: (TensorDataset(x, y), y), {}, "y must be left out when x is a DataLoader"),
    (lambda x, y: (TensorDataset(x, y + 1),), {}, "labels must be in 0..2"),
    (lambda x, y: (TensorDataset(x[:0], y[:0]),), {}, "x holds no samples"),
    (lambda x, y: (TensorDataset(x.long(), y),), {}, "batches must be floating-point"),
    (lambda x, y: ([1, 2],), {}, "x must be a torch.Tensor, a DataLoader or a Dataset"),
    (lambda x, y: (x, y), {"num_classes": 4}, "head 'fc3' has 3 outputs, not num_classes=4"),
    (lambda x, y: (x, y), {"num_classes": 1}, "num_classes must be >= 2, got 1"),
    (lambda x, y: (x, y + 3), {"head": "fc1"}, "y must be in 0..4"),  # fc1: 5 outputs
    (lambda x, y: (x, y), {"head": "conv"}, "head 'conv' is a Conv2d, not a torch.nn.Linear"),
    (lambda x, y: (x, y), {"head": "fc9"}, "has no submodule 'fc9'"),
    (lambda x, y: (x, y), {"clip": 0.0}, "clip must be a finite number > 0, got 0.0"),
    (lambda x, y: (x, y), {"clip": math.inf}, "clip must be a finite number > 0"),
    (lambda x, y: (x, y), {"batch_size": 0}, "batch_size must be >= 1, got 0"),
    (lambda x, y: (x, y), {"batch_keys": "xy"}, "batch_keys must be a pair of batch keys"),
])
def test_ccvr_statistics_refuses_bad_input_in_one_line(net, data, args, kwargs, needle):
    with pytest.raises(UsageError) as exc:
        ccvr_statistics(net, *args(*data), **kwargs)
    message = str(exc.value)
    assert needle in message and "\n" not in message


def test_models_without_a_linear_head_or_with_nan_features_are_refused(data):
    x, y = data
    with pytest.raises(UsageError, match="model must be a torch.nn.Module, got str"):
        ccvr_statistics("net", x, y, 3)
    with pytest.raises(UsageError, match="has no torch.nn.Linear module to calibrate"):
        ccvr_statistics(nn.Sequential(nn.Flatten(), nn.ReLU()), x, y, 3)
    broken = Net()
    with torch.no_grad():
        broken.fc1.bias.fill_(math.nan)
    with pytest.raises(UsageError, match="features of x are not finite"):
        ccvr_statistics(broken, x, y)
    from privfedcal.models import create_model

    own = create_model("mlp", num_classes=3, in_channels=1, image_size=8)
    with pytest.raises(UsageError, match=r"num_classes=4 differs from the model's classifier"):
        ccvr_statistics(own, x, y, 4)


# ---- privatize_statistics ----------------------------------------------------------------
def test_privatize_statistics_adds_the_noise_opacus_plans():
    """One release at sample rate 1: sigma from opacus' RDP accountant, called directly;
    each key's std is sigma * sqrt(3 keys) * its sensitivity (1, clip, clip^2)."""
    from opacus.accountants.utils import get_noise_multiplier

    eps, delta, clip = 4.0, 1e-5, 2.0
    sigma = get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=1.0,
                                 steps=1, accountant="rdp", epsilon_tolerance=0.001)
    c, d = 4000, 12  # many entries per key, so that each std is measured to ~1%
    zeros = {"count": torch.zeros(c, dtype=torch.float64),
             "sum": torch.zeros(c, d, dtype=torch.float64),
             "outer": torch.zeros(c, d, d, dtype=torch.float64)}
    noisy = privatize_statistics(zeros, epsilon=eps, delta=delta, clip=clip)
    for key, sens in (("count", 1.0), ("sum", clip), ("outer", clip * clip)):
        want = sigma * math.sqrt(3) * sens
        assert float(noisy[key].std()) == pytest.approx(want, rel=0.05), key
    again = privatize_statistics(zeros, epsilon=eps, delta=delta, clip=clip)
    assert not torch.equal(noisy["sum"], again["sum"])  # fresh OS-entropy noise each call


def _stats(c=3, d=4):
    return {"count": torch.full((c,), 2.0, dtype=torch.float64),
            "sum": torch.zeros(c, d, dtype=torch.float64),
            "outer": torch.eye(d, dtype=torch.float64).repeat(c, 1, 1) * 0.5}


def _with(**changes):
    s = _stats()
    s.update(changes)
    return {k: v for k, v in s.items() if v is not None}


BAD_STATS = [
    (_with(outer=None), "stats must have the keys count, sum and outer"),
    ({**_stats(), "extra": torch.zeros(3)}, "got 'count', 'extra', 'outer', 'sum'"),
    (_with(sum=torch.full((3, 4), math.nan, dtype=torch.float64)),
     "stats['sum'] has NaN or Inf values"),
    (_with(outer=torch.full((3, 4, 4), math.inf)), "stats['outer'] has NaN or Inf values"),
    (_with(count=torch.ones(3, dtype=torch.bool)), "stats['count'] must be a real tensor"),
    (_with(count=torch.ones(3, 1)), "stats['count'] must have shape (C,) with C >= 2"),
    (_with(sum=torch.zeros(2, 4)), "stats['sum'] must have shape (C, d) = (3, d), got (2, 4)"),
    (_with(outer=torch.zeros(3, 4, 5)), "stats['outer'] must have shape (C, d, d) = (3, 4, 4)"),
]


@pytest.mark.parametrize(("stats", "needle"), BAD_STATS)
def test_malformed_statistics_are_refused_naming_the_key(stats, needle, net):
    for call in (lambda: privatize_statistics(stats, epsilon=1.0, delta=1e-5, clip=1.0),
                 lambda: calibrate_head(net, stats, head="fc1")):
        with pytest.raises(UsageError) as exc:
            call()
        assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_statistics_beyond_the_clip_are_refused(net, data):
    x, y = data
    plain = ccvr_statistics(net, x, y)
    with pytest.raises(UsageError, match=r"stats exceed clip=1e-06: class \d has sum of "
                                         r"squared feature norms"):
        privatize_statistics(plain, epsilon=1.0, delta=1e-5, clip=1e-6)
    clipped = ccvr_statistics(net, x, y, clip=0.05)  # every row clipped to norm 0.05 here
    out = privatize_statistics(clipped, epsilon=1.0, delta=1e-5, clip=0.05)
    assert set(out) == {"count", "sum", "outer"}
    with pytest.raises(UsageError, match="need epsilon > 0 and 0 < delta < 1"):
        privatize_statistics(clipped, epsilon=math.inf, delta=1e-5, clip=0.05)
    with pytest.raises(UsageError, match="need epsilon > 0 and 0 < delta < 1"):
        privatize_statistics(clipped, epsilon=1.0, delta=1.0, clip=0.05)


# ---- calibrate_head ----------------------------------------------------------------------
class TwoStage(nn.Module):
    """Features = x (a frozen identity layer), then a 3-class head ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.body.bias.zero_()
        self.out = nn.Linear(2, 3)

    def forward(self, x):
        return self.out(self.body(x))


def test_calibrate_head_fits_a_users_head_to_the_class_gaussians():
    """Three separated 2-d clusters: a head re-trained on virtual features drawn from their
    statistics classifies the real points; only the head moves, under its own names."""
    g = torch.Generator().manual_seed(3)
    centres = torch.tensor([[4.0, 0.0], [-4.0, 0.0], [0.0, 4.0]])
    y = torch.arange(300) % 3
    x = centres[y] + 0.5 * torch.randn(300, 2, generator=g)
    torch.manual_seed(0)
    model = TwoStage()
    with torch.no_grad():
        model.out.weight.copy_(torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.01]]))
    before = (model(x).argmax(1) == y).float().mean().item()
    body = model.body.weight.clone()
    stats = ccvr_statistics(model, x, y, head="out")
    assert calibrate_head(model, stats, virtual_per_class=200, head="out", seed=0) is model
    after = (model(x).argmax(1) == y).float().mean().item()
    assert before < 0.4 and after > 0.95
    assert torch.equal(model.body.weight, body)
    assert list(model.state_dict()) == ["body.weight", "body.bias", "out.weight", "out.bias"]


def test_calibrate_head_refuses_statistics_that_do_not_fit_the_head(net):
    with pytest.raises(UsageError, match=r"stats are for 3 classes of 4 features, the "
                                         r"model's head has 3 outputs of 5 inputs"):
        calibrate_head(net, _stats(), head="fc3")
    empty = _stats(d=5)
    empty["count"] = torch.tensor([0.2, -1.0, 0.5], dtype=torch.float64)
    with pytest.raises(UsageError, match="no class with a count above 0.5"):
        calibrate_head(net, empty)
    with pytest.raises(UsageError, match="virtual_per_class must be >= 1"):
        calibrate_head(net, _stats(d=5), virtual_per_class=0)
    with pytest.raises(UsageError, match="model must be a torch.nn.Module"):
        calibrate_head(None, _stats(d=5))
