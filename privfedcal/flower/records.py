"""What crosses the wire under Flower: model states and payloads as ArrayRecords, the run
configuration as Flower's flat run config.

Arrays travel as NumPy ``.npy`` bytes written and read with ``allow_pickle=False`` (Flower's
``Array``), so nothing that crosses the client/server boundary is ever unpickled. dtypes are
kept exactly (float64 statistics stay float64, BatchNorm counters stay int64).

Run config (``[tool.flwr.app.config]`` of the Flower app, or ``flwr run --run-config``):
every ``RunConfig`` field under its CLI spelling (``local-epochs = 1``), method and
calibration hyperparameters as dotted keys (``method-params.mu = 0.01``,
``calibration-params.virtual_per_class = 50``), Flower-only settings as ``flower.*`` keys
(``FlowerOptions``). TOML has no null: ``""`` means None (the default) for a field whose
default is None and for every hyperparameter. ``flwr run --run-config`` only overrides keys
the app's pyproject declares, so the example app declares them all, unset ones as ``""``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

from privfedcal.config import RunConfig
from privfedcal.errors import UsageError

State = dict[str, Tensor]

METHOD_PARAMS = "method-params."
CALIBRATION_PARAMS = "calibration-params."
FLOWER = "flower."


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


@dataclass(frozen=True)
class FlowerOptions:
    """Flower-only settings (``flower.*`` run-config keys).

    round_timeout: seconds to wait for all replies of one exchange before the round fails;
    poll_interval: seconds between two pulls of replies from the SuperLink;
    node_wait: seconds the ServerApp waits for ``clients`` SuperNodes to connect;
    key_holder: the client whose SuperNode holds the CKKS secret key (``--secagg``).
    """

    round_timeout: float = 3600.0
    poll_interval: float = 0.2
    node_wait: float = 300.0
    key_holder: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.key_holder, bool) or not isinstance(self.key_holder, int) \
                or self.key_holder < 0:
            raise UsageError(f"flower.key-holder must be a client index >= 0, got "
                             f"{self.key_holder!r}")
        for name in ("round_timeout", "poll_interval", "node_wait"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise UsageError(f"flower.{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {value!r}")


def _optional_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(RunConfig) if f.default is None}


def parse_run_config(user_config: Mapping[str, Any]) -> tuple[RunConfig, FlowerOptions]:
    """Flower's flat run config -> (RunConfig, FlowerOptions); unknown keys raise UsageError."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    optional = _optional_fields()
    flat: dict[str, Any] = {"method_params": {}, "calibration_params": {}}
    options: dict[str, Any] = {}
    unknown = []
    for raw_key, value in user_config.items():
        if raw_key.startswith(METHOD_PARAMS):
            name = raw_key[len(METHOD_PARAMS):].replace("-", "_")
            flat["method_params"][name] = None if value == "" else value
        elif raw_key.startswith(CALIBRATION_PARAMS):
            name = raw_key[len(CALIBRATION_PARAMS):].replace("-", "_")
            flat["calibration_params"][name] = None if value == "" else value
        elif raw_key.startswith(FLOWER):
            options[raw_key[len(FLOWER):].replace("-", "_")] = value
        else:
            key = raw_key.replace("-", "_")
            if key not in fields or key in ("method_params", "calibration_params"):
                unknown.append(raw_key)
            elif value == "" and key in optional:
                flat[key] = None
            else:
                flat[key] = value
    if unknown:
        raise UsageError(f"run config: unknown setting(s) {', '.join(sorted(unknown))}")
    option_names = {f.name for f in dataclasses.fields(FlowerOptions)}
    bad = sorted(set(options) - option_names)
    if bad:
        valid = ", ".join(FLOWER + n.replace("_", "-") for n in sorted(option_names))
        raise UsageError(f"run config: unknown Flower option(s) "
                         f"{', '.join(FLOWER + b for b in bad)}; valid: {valid}")
    try:
        cfg = RunConfig.from_dict(flat)
    except TypeError as exc:  # a value of the wrong kind reaching a field
        raise UsageError(f"run config: {exc}") from None
    return cfg, FlowerOptions(**options)


def to_run_config(cfg: RunConfig, options: FlowerOptions | None = None) -> dict[str, Any]:
    """The Flower run config that ``parse_run_config`` maps back to ``cfg`` (for tests,
    ``--run-config`` overrides and the benchmark)."""
    out: dict[str, Any] = {}
    for key, value in cfg.to_dict().items():
        if key in ("method_params", "calibration_params"):
            prefix = METHOD_PARAMS if key == "method_params" else CALIBRATION_PARAMS
            out.update({prefix + k: v for k, v in value.items() if v is not None})
        elif value is None:
            out[key.replace("_", "-")] = "" if key in _optional_fields() else math.inf
        else:
            out[key.replace("_", "-")] = value
    if options is not None:
        for f in dataclasses.fields(options):
            out[FLOWER + f.name.replace("_", "-")] = getattr(options, f.name)
    return out
