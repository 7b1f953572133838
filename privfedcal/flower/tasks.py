"""Payload tasks as Flower records: a task travels as its *description*, never a pickle.

A calibrator asks for uploads with a ``PayloadTask`` object (``federation/hooks.py``). Under
Flower the server sends the task's registered name plus its fields: tensors in an
ArrayRecord (``task-arrays``), scalars in a ConfigRecord (``task``). The client looks the name
up in ``TASKS`` and rebuilds the same frozen dataclass, so it runs exactly the
``task.compute(model, x, y, bound)`` code of the in-process simulator. Only registered classes
can be built, and only from their declared fields: a message cannot make a client run
anything else.

A calibrator's tasks are found through its release declarations (``ReleaseSpec.task``,
under the release's label): nothing to do here for a new calibrator. Any other task (a
frozen dataclass whose fields are tensors, None, bool, int, float or str) is registered by
hand, and a name registered by hand wins over a release's label::

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

#: payload tasks that no calibrator's release declares
TASKS: Registry[type] = Registry("payload task")

TASK_CONFIG = "task"          # ConfigRecord: name, scalar fields, names of None fields
TASK_ARRAYS = "task-arrays"   # ArrayRecord: tensor fields
_FIELD = "field."
_NONE = "none-fields"
_SCALARS = (bool, int, float, str)


def known_tasks() -> dict[str, type]:
    """Every task a message may name: the registered calibrators' release tasks under the
    release's label, and ``TASKS``."""
    from privfedcal.federation.hooks import CALIBRATORS

    known = {release.label: release.task for _, cal in CALIBRATORS.items()
             for release in cal.releases if release.task is not None}
    return dict(sorted({**known, **dict(TASKS.items())}.items()))


def task_name(task: PayloadTask) -> str:
    """The registered name of ``task``'s class (UsageError if it has none)."""
    known = known_tasks()
    for name, cls in known.items():
        if cls is type(task):
            return name
    raise UsageError(f"payload task {type(task).__name__} is not registered for Flower; "
                     f"registered: {', '.join(known)}")


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
    known = known_tasks()
    name = config.get("name")
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"unknown payload task {name!r}; registered: {', '.join(known)}")
    cls = known[name]
    nones = [n for n in str(config.get(_NONE, "")).split(",") if n]
    values: dict[str, Any] = {n: None for n in nones}
    for key, value in config.items():
        if key.startswith(_FIELD):
            values[key[len(_FIELD):]] = value
    for key, array in arrays.items():
        values[key] = array_to_tensor(array, device)
    declared = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(values) - declared)
    if extra:
        raise ValueError(f"payload task {name!r} has no field(s) {', '.join(extra)}")
    # every field explicit: a client never fills a gap with its own (possibly other) default
    missing = sorted(declared - set(values))
    if missing:
        raise ValueError(f"payload task {name!r} misses field(s) {', '.join(missing)}")
    return cls(**values)
