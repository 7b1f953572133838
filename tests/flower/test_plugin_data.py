"""privfedcal.flower.plugin.data: a node's DataLoader or Dataset as batches, and payload
tasks summed batch by batch equal to the task on the whole data at once."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from plugin_app import DictDigits, Net  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privfedcal.calibration.ccvr import StatsTask  # noqa: E402
from privfedcal.calibration.creff import GradTask  # noqa: E402
from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.plugin import data  # noqa: E402
from privfedcal.models.head_adapter import HeadAdapter  # noqa: E402
from privfedcal.privacy.dp import L2Clip  # noqa: E402


@pytest.fixture(scope="module")
def sample():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (70,), generator=g)
    torch.manual_seed(0)
    return HeadAdapter(Net(), "fc3").eval(), x, y


def test_pairs_and_mappings_give_the_same_batches(sample):
    _, x, y = sample
    pairs = list(data.batches(TensorDataset(x, y), batch_size=32))
    maps = list(data.batches(DataLoader(DictDigits(x, y), batch_size=32)))
    assert [len(b[1]) for b in pairs] == [32, 32, 6]
    for (xa, ya), (xb, yb) in zip(pairs, maps, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert data.num_samples(DataLoader(DictDigits(x, y), batch_size=32)) == 70


def test_bad_batches_are_one_line_errors(sample):
    _, x, y = sample
    with pytest.raises(UsageError, match="labels must be in 0..4"):
        list(data.batches(TensorDataset(x, y), num_classes=5))
    with pytest.raises(UsageError, match="none of which names its inputs"):
        list(data.batches(DataLoader([{"pic": x[0], "label": y[0]}])))
    with pytest.raises(UsageError, match="one integer class per sample"):
        list(data.batches(TensorDataset(x, y.float())))
    with pytest.raises(UsageError, match="DataLoader or Dataset"):
        list(data.batches(42))


@pytest.mark.parametrize("task", [
    StatsTask(10),
    GradTask(torch.randn(10, 16), torch.randn(10), 10, weighting="sample"),
    GradTask(torch.randn(10, 16), torch.randn(10), 10, weighting="client"),
    GradTask(torch.randn(10, 16), None, 10, weighting="client", per_class_cap=3, seed=5),
], ids=["ccvr", "creff-sample", "creff-client", "creff-capped"])
def test_batchwise_payload_equals_the_whole_data_payload(sample, task):
    model, x, y = sample
    bound = L2Clip({"feature": 2.0, "class-gradient": 0.5})
    whole = task.compute(model, x, y, bound)
    batched = data.compute(task, model, TensorDataset(x, y), bound, batch_size=16)
    assert set(batched) == set(whole)
    for k in whole:
        assert torch.allclose(batched[k], whole[k], atol=1e-9), k
