"""Payload tasks travel as descriptions (flower/tasks.py): rebuilt tasks compute the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402
from loopback import over_the_wire  # noqa: E402

from privfedcal.calibration.ccvr import StatsTask  # noqa: E402
from privfedcal.calibration.creff import GradTask  # noqa: E402
from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.tasks import (  # noqa: E402
    TASK_ARRAYS,
    TASK_CONFIG,
    known_tasks,
    task_from_records,
    task_to_records,
)
from privfedcal.models import create_model  # noqa: E402
from privfedcal.privacy.bound import NoBound  # noqa: E402

torch.manual_seed(0)


@pytest.fixture(scope="module")
def model_and_data():
    g = torch.Generator().manual_seed(1)
    model = create_model("mlp", num_classes=4, in_channels=1, image_size=4, generator=g)
    model.eval()
    x = torch.randn(30, 1, 4, 4, generator=g)
    y = torch.randint(0, 3, (30,), generator=g)  # class 3 absent: same shapes regardless
    return model, x, y


def _through_flower(task):
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    msg = Message(RecordDict(task_to_records(task)), dst_node_id=5, message_type="query.payload")
    received, _ = over_the_wire(msg)
    return task_from_records(received.content[TASK_CONFIG], received.content[TASK_ARRAYS])


def _tasks(model):
    w, b = model.classifier.weight.detach(), model.classifier.bias.detach()
    return [StatsTask(4), StatsTask(4, tukey=True, tukey_lambda=0.25, batch_size=7),
            GradTask(w.clone(), b.clone(), 4, "client", 16),
            GradTask(w.double(), None, 4, "sample")]


@pytest.mark.parametrize("i", range(4))
def test_rebuilt_task_computes_the_same_payload(i, model_and_data):
    model, x, y = model_and_data
    task = _tasks(model)[i]
    back = _through_flower(task)
    assert type(back) is type(task)
    for f in dataclasses.fields(task):
        a, b = getattr(task, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b
    want = task.compute(model, x, y, NoBound())
    got = back.compute(model, x, y, NoBound())
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k])


def test_unregistered_task_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Sneaky:
        n: int = 1

    with pytest.raises(UsageError, match="not registered"):
        task_to_records(Sneaky())


@pytest.mark.parametrize("config, arrays, message", [
    ({"name": "os.system"}, {}, "unknown payload task"),
    ({"name": "ccvr-stats", "field.num_classes": 3, "field.command": "rm"}, {}, "no field"),
    ({"name": "ccvr-stats", "none-fields": "num_classes,evil"}, {}, "no field"),
    ({"name": "ccvr-stats", "field.num_classes": 3}, {}, "misses field"),
])
def test_forged_descriptions_are_refused(config, arrays, message):
    with pytest.raises(ValueError, match=message):
        task_from_records(ConfigRecord(config), ArrayRecord(arrays))


def test_registry_lists_the_builtin_tasks():
    assert {"ccvr-stats", "creff-grad"} <= set(known_tasks())
