"""create_calibrator: registry lookup, spec argument, flat CLI options."""

from __future__ import annotations

import pytest
import torch

from privfedcal.calibration import CCVR, CReFF, Oracle, create_calibrator
from privfedcal.calibration.creff import CReFFParams
from privfedcal.errors import UsageError
from privfedcal.federation.hooks import CALIBRATORS, CalibrationSpec, Calibrator

torch.set_num_threads(1)


def make(name, arg=None, **options):
    return create_calibrator(CalibrationSpec(name, arg), num_classes=3, feature_dim=4,
                             options=options)


def test_registry_names_and_unknown_name():
    assert {"none", "ccvr", "creff", "oracle"} <= set(CALIBRATORS.names())
    with pytest.raises(UsageError, match="valid choices: .*ccvr"):
        make("ccvr2")
    assert type(make("none")) is Calibrator
    with pytest.raises(UsageError):
        make("none", 5)


def test_spec_argument_and_options():
    ccvr = make("ccvr", 500, tukey=True, virtual_mode=None, steps=7, seed=1, match_steps=3)
    assert isinstance(ccvr, CCVR)
    assert (ccvr.params.virtual_per_class, ccvr.params.tukey, ccvr.params.steps) == (500, True, 7)
    assert ccvr.params.virtual_mode == "balanced"            # None = default
    oracle = make("oracle", 100)
    assert isinstance(oracle, Oracle) and oracle.params.per_class == 100
    assert make("oracle").params.per_class is None
    creff = make("creff", None, creff_weighting="sample", weighting="client", match_steps=3)
    assert isinstance(creff, CReFF)
    assert creff.params == CReFFParams(weighting="sample", match_steps=3)


@pytest.mark.parametrize("name,options", [
    ("ccvr", {"virtual_mode": "uniform"}), ("ccvr", {"lr": -1.0}),
    ("creff", {"creff_weighting": "median"}), ("creff", {"features_per_class": 0}),
    ("creff", {"creff_dsa": "color_blur"}), ("creff", {"dsa": "flip_flip"}),
    ("oracle", {"batch_size": 0}),
])
def test_bad_values_are_usage_errors(name, options):
    with pytest.raises(UsageError):
        make(name, **options)


@pytest.mark.parametrize("name", [n for n in CALIBRATORS.names() if n != "none"])
def test_every_calibrator_state_dict_is_tensors_only(name, make_context):
    ctx = make_context()
    # the fake clients hold feature vectors, not images: CReFF without its image augmentation
    cal = make(name, None, match_steps=2, retrain_steps=2, features_per_class=2, steps=2,
               dsa="none")
    cal.after_round(ctx)
    cal.after_training(ctx)
    state = cal.state_dict()
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    fresh = make(name, None)
    fresh.load_state_dict(state)
    for k, v in fresh.eval_state(ctx.global_state).items():
        assert torch.equal(v, cal.eval_state(ctx.global_state)[k])
