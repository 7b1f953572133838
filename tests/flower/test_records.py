"""ArrayRecord conversion and the run-config mapping (flower/records.py)."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("flwr")

from flwr.app import Array  # noqa: E402
from flwr.common.config import flatten_dict  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.records import (  # noqa: E402
    FlowerOptions,
    array_to_tensor,
    parse_run_config,
    record_to_state,
    state_to_record,
    to_run_config,
)
from privfedcal.settings.catalogue import CALIBRATION_SETTINGS  # noqa: E402
from privfedcal.settings.descriptions import settings_of  # noqa: E402
from privfedcal.settings.run_config import RunConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower" / "pyproject.toml"
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=1, max_size=4),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_state_round_trip_is_exact(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.w": (torch.randn(s, generator=g, dtype=torch.float64) * 100).to(dtype)
             for i, s in enumerate(shapes)}
    back = record_to_state(state_to_record(state))
    assert list(back) == list(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and back[k].shape == state[k].shape
        assert torch.equal(back[k], state[k])
        back[k].view(-1)[:1] = 0  # writable, not a view of the message bytes


def test_arrays_are_npy_without_pickle():
    record = state_to_record({"x": torch.arange(3.0)})
    assert record["x"].stype == "numpy.ndarray"
    assert record["x"].data[:6] == b"\x93NUMPY"
    # an object array cannot even be written without pickle, and is never read back
    with pytest.raises(ValueError):
        Array(np.array([{"a": 1}], dtype=object))
    forged = Array(dtype="object", shape=(1,), stype="numpy.ndarray",
                   data=b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, "
                        b"'shape': (1,), }" + b" " * 52 + b"\n" + b"\x80\x04N.")
    with pytest.raises(ValueError):
        array_to_tensor(forged)


def test_run_config_round_trip():
    cfg = RunConfig.of(method="fedprox", method_params={"mu": 0.05}, clients=3, alpha=0.3,
                    calibrate="ccvr", calibration_params={"virtual_per_class": 7},
                    dp_eps=4.0, dp_delta=1e-5, threads=None, augment=False)
    opts = FlowerOptions(round_timeout=30.0, poll_interval=0.5, node_wait=9.0)
    back, back_opts = parse_run_config(to_run_config(cfg, opts))
    assert back == cfg and back_opts == opts
    assert math.isinf(parse_run_config(to_run_config(RunConfig()))[0].dp_eps)


def test_run_config_spelling_and_unset_values():
    cfg, opts = parse_run_config({"local-epochs": 3, "model": "", "method-params.mu": "",
                                  "method-params.server-lr": 0.5, "flower.poll-interval": 1})
    assert cfg.training.local_epochs == 3 and cfg.model is None
    assert cfg.method_params == {"mu": None, "server_lr": 0.5}
    assert opts.poll_interval == 1 and opts.round_timeout == FlowerOptions().round_timeout


@pytest.mark.parametrize("bad, message", [
    ({"local_epoch": 1}, "unknown setting"),
    ({"flower.timeout": 3}, "unknown Flower option"),
    ({"flower.poll-interval": 0}, "positive number"),
    ({"rounds": 0}, "--rounds"),
    ({"method-params": 1}, "unknown setting"),
])
def test_bad_run_config_is_a_usage_error(bad, message):
    with pytest.raises(UsageError, match=message):
        parse_run_config(bad)


def test_example_app_declares_every_setting():
    """``flwr run --run-config`` only overrides declared keys: the example declares all."""
    raw = tomllib.loads(EXAMPLE.read_text())
    config = flatten_dict(raw["tool"]["flwr"]["app"]["config"])
    cfg, opts = parse_run_config(config)
    declared = {k.replace("-", "_") for k in config if "." not in k}
    fields = {s.name for s in settings_of(RunConfig, "run")} - {"method_params",
                                                                 "calibration_params"}
    assert fields <= declared
    assert {"mu", "tau", "beta", "server_lr", "lam"} <= set(cfg.method_params)
    assert {s.name for s in CALIBRATION_SETTINGS} <= set(cfg.calibration_params)
    assert raw["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "privfedcal.flower.server_app:app",
        "clientapp": "privfedcal.flower.client_app:app"}
    feds = raw["tool"]["flwr"]["federations"]
    assert {"local-simulation", "local-deployment"} <= set(feds)
    assert feds["local-deployment"]["address"].startswith("127.0.0.1:")
    assert opts == FlowerOptions(round_timeout=config["flower.round-timeout"],
                                 poll_interval=config["flower.poll-interval"],
                                 node_wait=config["flower.node-wait"],
                                 key_holder=config["flower.key-holder"])


def test_batchnorm_state_loads_back_into_the_model():
    """ResNet-8's BatchNorm buffers, incl. the 0-d int64 ``num_batches_tracked``."""
    from privfedcal.models import create_model

    model = create_model("resnet8", num_classes=10, in_channels=1, image_size=8,
                         generator=torch.Generator().manual_seed(0))
    model.train()
    model(torch.randn(4, 1, 8, 8))  # move the running statistics off their init
    state = {k: v.clone() for k, v in model.state_dict().items()}
    back = record_to_state(state_to_record(state))
    counters = [k for k in state if k.endswith("num_batches_tracked")]
    assert counters and all(back[k].dim() == 0 and back[k].dtype == torch.int64
                            for k in counters)
    model.load_state_dict(back)  # strict: same keys, shapes and dtypes
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


@pytest.mark.parametrize("bad, message", [
    ({"rounds": "3"}, "run config: rounds must be an integer, got '3'"),
    ({"alpha": True}, "run config: alpha must be a number"),
    ({"method-params.mu": "big"}, "run config: mu must be a number"),
    ({"calibration-params.virtual-per-class": 2.5}, "virtual_per_class must be an integer"),
    ({"flower.key-holder": 1.5}, "flower.key_holder must be an integer"),
    ({"flower.round-timeout": "600"}, "flower.round_timeout must be a number"),
])
def test_run_config_types_are_the_described_ones(bad, message):
    with pytest.raises(UsageError, match=message):
        parse_run_config(bad)


def test_run_config_accepts_either_spelling_and_widens_ints():
    cfg, opts = parse_run_config({"local_epochs": 2, "calibration-params.virtual_per_class": 5,
                                  "alpha": 1, "flower.node-wait": 30})
    assert cfg.training.local_epochs == 2 and cfg.calibration_params == {"virtual_per_class": 5}
    assert type(cfg.data.alpha) is float and opts.node_wait == 30
