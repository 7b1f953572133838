"""Payload tasks as Flower records: a task travels as its *description*, never a pickle.

A calibrator asks for uploads with a ``PayloadTask`` object (``federation/hooks.py``). Under
Flower the server sends the task's registered name plus its fields: tensors in an
ArrayRecord (``task-arrays``), scalars in a ConfigRecord (``task``). The client looks the name
up in ``TASKS`` and rebuilds the same frozen dataclass, so it runs exactly the
``task.compute(model, x, y, bound)`` code of the in-process simulator. Only registered classes
can be built, and only from their declared fields: a message cannot make a client run
anything else.

A calibrator's tasks are registered from its release declarations (``ReleaseSpec.task``):
nothing to do here for a new calibrator. Any other task (a frozen dataclass whose fields are
tensors, None, bool, int, float or str) is registered by hand::

    TASKS.register("my-task")(MyTask)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.federation.hooks import PayloadTask
from privfedcal.flower.records import array_to_tensor, tensor_to_array
from privfedcal.registry import Registry

TASKS: Registry[type] = Registry("payload task")

TASK_CONFIG = "task"          # ConfigRecord: name, scalar fields, names of None fields
TASK_ARRAYS = "task-arrays"   # ArrayRecord: tensor fields
_FIELD = "field."
_NONE = "none-fields"
_SCALARS = (bool, int, float, str)


def _register_builtin() -> None:
    """Every registered calibrator's release tasks, under the release's label."""
    import privfedcal.calibration  # noqa: F401  (registers the calibrators)
    from privfedcal.federation.hooks import CALIBRATORS

    for cal in CALIBRATORS.names():
        for release in CALIBRATORS.get(cal).releases:
            if release.task is not None and release.label not in TASKS:
                TASKS.register(release.label)(release.task)


def task_name(task: PayloadTask) -> str:
    """The registered name of ``task``'s class (UsageError if it has none)."""
    _register_builtin()
    for name in TASKS.names():
        if TASKS.get(name) is type(task):
            return name
    raise UsageError(f"payload task {type(task).__name__} is not registered for Flower; "
                     f"registered: {', '.join(TASKS.names())}")


def task_to_records(task: PayloadTask) -> dict[str, Any]:
    """``{"task": ConfigRecord, "task-arrays": ArrayRecord}`` describing ``task``."""
    name = task_name(task)
    if not dataclasses.is_dataclass(task):
        raise UsageError(f"payload task {name!r} must be a dataclass to travel under Flower")
    config: dict[str, Any] = {"name": name}
    arrays = ArrayRecord()
    nones: list[str] = []
    for f in dataclasses.fields(task):
        value = getattr(task, f.name)
        if value is None:
            nones.append(f.name)
        elif isinstance(value, Tensor):
            arrays[f.name] = tensor_to_array(value)
        elif isinstance(value, _SCALARS):
            config[_FIELD + f.name] = value
        else:
            raise UsageError(f"payload task {name!r}: field {f.name} of type "
                             f"{type(value).__name__} cannot travel (tensor or scalar only)")
    config[_NONE] = ",".join(nones)
    return {TASK_CONFIG: ConfigRecord(config), TASK_ARRAYS: arrays}


def task_from_records(config: ConfigRecord, arrays: ArrayRecord,
                      device: Any = None) -> PayloadTask:
    """Rebuild the task described by ``task_to_records``; anything else (unknown name, a
    field too many or too few) raises ValueError."""
    _register_builtin()
    name = config.get("name")
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"unknown payload task {name!r}; registered: {', '.join(TASKS.names())}")
    cls = TASKS.get(name)
    nones = [n for n in str(config.get(_NONE, "")).split(",") if n]
    values: dict[str, Any] = {n: None for n in nones}
    for key, value in config.items():
        if key.startswith(_FIELD):
            values[key[len(_FIELD):]] = value
    for key, value in arrays.items():
        values[key] = array_to_tensor(value, device)
    declared = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(values) - declared)
    if extra:
        raise ValueError(f"payload task {name!r} has no field(s) {', '.join(extra)}")
    # every field explicit: a client never fills a gap with its own (possibly other) default
    missing = sorted(declared - set(values))
    if missing:
        raise ValueError(f"payload task {name!r} misses field(s) {', '.join(missing)}")
    return cls(**values)
