"""What crosses the wire under Flower: model states and payloads as ArrayRecords, the run
configuration as Flower's flat run config.

Arrays travel as NumPy ``.npy`` bytes written and read with ``allow_pickle=False`` (Flower's
``Array``), so nothing that crosses the client/server boundary is ever unpickled. dtypes are
kept exactly (float64 statistics stay float64, BatchNorm counters stay int64).

Run config (``[tool.flwr.app.config]`` of the Flower app, or ``flwr run --run-config``):
every ``RunConfig`` field under its CLI spelling (``local-epochs = 1``), method and
calibration hyperparameters as dotted keys (``method-params.mu = 0.01``,
``calibration-params.virtual-per-class = 50``), Flower-only settings as ``flower.*`` keys
(``FlowerOptions``); ``_`` may stand for ``-``. Keys, types and defaults are the settings'
description (privfedcal/settings/catalogue.py: ``flower_defaults()`` is what the example app declares). TOML has no null: ``""`` means None (the default) for a field whose
default is None and for every hyperparameter. ``flwr run --run-config`` only overrides keys
the app's pyproject declares, so the example app declares them all, unset ones as ``""``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.settings.catalogue import (
    FLOWER_PREFIX,
    FlowerOptions,
    check_value,
    flower_key,
    flower_settings,
)
from privfedcal.settings.run_config import RunConfig
from privfedcal.tensors import State

__all__ = ["FlowerOptions", "parse_run_config", "to_run_config"]


METHOD_PARAMS = FLOWER_PREFIX["method"]
CALIBRATION_PARAMS = FLOWER_PREFIX["calibration"]
FLOWER = FLOWER_PREFIX["flower"]


def tensor_to_array(t: Tensor) -> Array:
    """A detached CPU copy of ``t`` as a Flower ``Array`` (npy bytes, no pickle)."""
    if t.dtype == torch.bfloat16:
        t = t.float()
    return Array(t.detach().cpu().contiguous().numpy())  # np.ascontiguousarray makes 0-d 1-d


def array_to_tensor(a: Array, device: torch.device | str | None = None) -> Tensor:
    """A writable tensor from a Flower ``Array``; refuses anything but plain npy data."""
    data = a.numpy()  # np.load(..., allow_pickle=False) inside Flower
    if data.dtype == object:
        raise ValueError("object arrays are not accepted")
    return torch.from_numpy(np.array(data, copy=True)).to(device)


def state_to_record(state: Mapping[str, Tensor]) -> ArrayRecord:
    """A model state (or payload) as an ArrayRecord, keys in the same order."""
    record = ArrayRecord()
    for key, value in state.items():
        record[key] = tensor_to_array(value)
    return record


def record_to_state(record: ArrayRecord, device: torch.device | str | None = None) -> State:
    """The inverse of ``state_to_record``."""
    return {key: array_to_tensor(value, device) for key, value in record.items()}


RecordT = TypeVar("RecordT", ArrayRecord, ConfigRecord, MetricRecord)


def record_at(content: RecordDict, key: str, kind: type[RecordT]) -> RecordT:
    """The record a message holds at ``key``, of the kind the protocol puts there."""
    record = content[key]
    if not isinstance(record, kind):
        raise ValueError(f"the message's {key!r} is a {type(record).__name__}, "
                         f"not a {kind.__name__}")
    return record


def as_int(value: object) -> int:
    """A record's number (or numeric string) as an int."""
    if not isinstance(value, int | float | str):
        raise ValueError(f"expected a number in the record, got {type(value).__name__}")
    return int(value)


def as_float(value: object) -> float:
    """A record's number as a float."""
    if not isinstance(value, int | float | str):
        raise ValueError(f"expected a number in the record, got {type(value).__name__}")
    return float(value)


def as_bytes(value: object) -> bytes:
    """A record's bytes value."""
    if not isinstance(value, bytes):
        raise ValueError(f"expected bytes in the record, got {type(value).__name__}")
    return bytes(value)


def as_list(value: object) -> list[Any]:
    """A record's list value."""
    if not isinstance(value, list):
        raise ValueError(f"expected a list in the record, got {type(value).__name__}")
    return value


def parse_run_config(user_config: Mapping[str, Any]) -> tuple[RunConfig, FlowerOptions]:
    """Flower's flat run config -> (RunConfig, FlowerOptions). Keys and types are the
    settings' (privfedcal/settings/catalogue.py); unknown keys and wrong types raise UsageError."""
    by_key = {flower_key(s): s for s in flower_settings()}
    flat: dict[str, Any] = {"method_params": {}, "calibration_params": {}}
    options: dict[str, Any] = {}
    unknown, bad_options = [], []
    for key, value in user_config.items():
        s = by_key.get(key.replace("_", "-"))
        if s is None and key.startswith(FLOWER):
            bad_options.append(key)
        elif s is None and key.startswith((METHOD_PARAMS, CALIBRATION_PARAMS)):
            # a hyperparameter without a flag: its method or calibrator checks it
            table, _, name = key.partition(".")
            flat[table.replace("-", "_")][name.replace("-", "_")] = None if value == "" else value
        elif s is None:
            unknown.append(key)
        elif s.scope == "flower":
            options[s.name] = check_value(s, value, "run config: flower.")
        else:
            value = None if value == "" and s.optional else value
            value = check_value(s, value, "run config: ")
            if s.scope == "run":
                flat[s.name] = value
            else:
                flat[f"{s.scope}_params"][s.name] = value
    if unknown:
        raise UsageError(f"run config: unknown setting(s) {', '.join(sorted(unknown))}")
    if bad_options:
        valid = ", ".join(k for k, s in by_key.items() if s.scope == "flower")
        raise UsageError(f"run config: unknown Flower option(s) {', '.join(bad_options)}; "
                         f"valid: {valid}")
    cfg, opts = RunConfig.from_dict(flat, where="run config"), FlowerOptions(**options)
    if cfg.privacy.secagg and cfg.privacy.secagg_key_holder is None:
        # the key holder is a client node here: every sum needs --secagg-min-clients uploads
        # besides its own (cohorts.secure_minimum); the server and every node derive it alike
        cfg = cfg.replace(secagg_key_holder=opts.key_holder)
    elif cfg.privacy.secagg and cfg.privacy.secagg_key_holder != opts.key_holder:
        raise UsageError(f"run config: secagg-key-holder {cfg.privacy.secagg_key_holder} "
                         f"differs from flower.key-holder {opts.key_holder}")
    return cfg, opts


def to_run_config(cfg: RunConfig, options: FlowerOptions | None = None) -> dict[str, Any]:
    """The Flower run config that ``parse_run_config`` maps back to ``cfg`` (for tests,
    ``--run-config`` overrides and the benchmark)."""
    out: dict[str, Any] = {}
    for key, value in cfg.to_dict().items():
        if key in ("method_params", "calibration_params"):
            prefix = METHOD_PARAMS if key == "method_params" else CALIBRATION_PARAMS
            out.update({prefix + k.replace("_", "-"): v for k, v in value.items()
                        if v is not None})
        elif value is None:
            out[key.replace("_", "-")] = "" if key != "dp_eps" else math.inf
        else:
            out[key.replace("_", "-")] = value
    if options is not None:
        for f in dataclasses.fields(options):
            out[FLOWER + f.name.replace("_", "-")] = getattr(options, f.name)
    return out
