"""federation/hooks.py: the simulator/calibrator contract and the calibrator registry."""

from __future__ import annotations

import pytest
import torch

import privfedcal.calibration  # noqa: F401  (registers the calibrators)
from privfedcal.errors import UsageError
from privfedcal.federation.hooks import CALIBRATORS, CalibrationSpec, Calibrator
from privfedcal.privacy.bound import NoBound


def test_registry_holds_the_four_calibrators_and_names_them_on_a_typo():
    assert CALIBRATORS.names() == ["ccvr", "creff", "none", "oracle"]
    assert CALIBRATORS.get("none") is Calibrator
    with pytest.raises(UsageError, match="valid choices: ccvr, creff, none, oracle"):
        CALIBRATORS.get("ccrv")
    with pytest.raises(ValueError, match="registered twice"):
        CALIBRATORS.register("ccvr")(Calibrator)


@pytest.mark.parametrize("name", CALIBRATORS.names())
def test_every_calibrator_declares_its_releases_and_names_itself(name):
    cls = CALIBRATORS.get(name)
    assert issubclass(cls, Calibrator) and cls.name == name
    labels = [r.label for r in cls.releases]
    expected = {"none": [], "oracle": [], "ccvr": ["ccvr-stats"], "creff": ["creff-grad"]}
    assert labels == expected[name]
    # the oracle reads raw training features: it cannot run under DP
    assert cls.protectable is (name != "oracle")


def test_the_base_calibrator_changes_nothing():
    cal = Calibrator()
    state = {"fc.weight": torch.ones(2, 3)}
    assert cal.eval_state(state) is state
    assert cal.feature_transform() is None
    assert cal.after_training(None) == {}  # type: ignore[arg-type]
    assert cal.after_round(None) is None  # type: ignore[func-returns-value, arg-type]
    assert cal.state_dict() == {}
    cal.load_state_dict({"anything": 1})
    assert CalibrationSpec() == CalibrationSpec("none", None)


def test_no_bound_is_the_identity():
    rows = torch.randn(5, 3, 2)
    assert NoBound().clip(rows, "features") is rows
