"""privfedcal.models.head_adapter: a user's model seen as a FeatureClassifier through its
head's input, with the user's parameter names kept outside."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from plugin_app import Net  # noqa: E402
from torch import nn  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.models.head_adapter import HeadAdapter, find_head  # noqa: E402


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_features_are_the_heads_input_computed_by_hand():
    model = _net()
    x = torch.randn(5, 1, 8, 8)
    adapter = HeadAdapter(model, "fc3")
    # the head's input, written out from Net.forward
    h = model.pool(F.relu(model.conv1(x))).flatten(1)
    want = F.relu(model.fc2(F.relu(model.fc1(h))))
    assert torch.allclose(adapter.features(x), want)
    assert torch.allclose(adapter(x), model(x))
    assert adapter.feature_dim == 16 and adapter.num_classes == 10
    assert adapter.classifier is model.fc3
    assert not model.fc3._forward_pre_hooks  # no hook left on the user's module


def test_head_found_as_the_last_linear():
    name, module = find_head(_net())
    assert name == "fc3" and module.out_features == 10


@pytest.mark.parametrize("head, num_classes, match", [
    ("fc9", None, "no submodule 'fc9'"),
    ("conv1", None, "not a torch.nn.Linear"),
    ("fc3", 7, "not num_classes=7"),
    (None, 7, "not num_classes=7"),
])
def test_bad_heads_are_one_line_errors(head, num_classes, match):
    with pytest.raises(UsageError, match=match) as info:
        HeadAdapter(_net(), head, num_classes)
    assert "\n" not in str(info.value)


def test_a_model_without_linear_is_refused():
    with pytest.raises(UsageError, match="no torch.nn.Linear"):
        HeadAdapter(nn.Sequential(nn.Conv2d(1, 2, 3)))


def test_states_use_privfedcal_names_inside_and_the_users_outside():
    model = _net()
    adapter = HeadAdapter(model, "fc3")
    inner = adapter.state_dict()
    assert "classifier.weight" in inner and "classifier.bias" in inner
    assert "fc3.weight" not in inner and "fc1.weight" in inner
    assert list(adapter.user_state(inner)) == list(model.state_dict())
    # a state loaded into the adapter lands in the user's own parameters
    new = {k: torch.full_like(v, 0.5) for k, v in inner.items()}
    adapter.load_state_dict(new)
    assert torch.equal(model.fc3.weight, torch.full_like(model.fc3.weight, 0.5))
    assert list(model.state_dict()) == list(Net().state_dict())


def test_a_head_that_is_not_the_output_fails_the_check():
    adapter = HeadAdapter(_net(), "fc1")  # 32 outputs; the model predicts with fc3
    with pytest.raises(UsageError, match="not its head 'fc1'"):
        adapter.check(torch.randn(4, 1, 8, 8))
    HeadAdapter(_net(), "fc3").check(torch.randn(4, 1, 8, 8))  # the real head passes


def test_other_classifier_keys_clash_with_the_head_names():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(4, 4)
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            return self.out(self.classifier(x))

    with pytest.raises(UsageError, match="besides its head 'out'"):
        HeadAdapter(Odd(), "out")
    assert HeadAdapter(Odd(), "classifier").user_key("classifier.weight") == "classifier.weight"
