"""The divergence guard: non-finite losses, model states, evaluations or calibration
results stop a run at the round where they appear (``errors.Diverged``, exit code 4).

The simulator calls these checks; each raises ``Diverged`` naming the round, the client
where known, what was non-finite and a hint. A NaN model is never evaluated as a result.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from privfedcal.errors import Diverged
from privfedcal.federation.local import LocalResult
from privfedcal.settings.messages import SettingText
from privfedcal.tensors import nonfinite_key

log = logging.getLogger("privfedcal.divergence")


def lr_hint(lr: float | None) -> str:
    now = f" (now {lr:g})" if lr is not None else ""
    if lr:
        return SettingText("lower the learning rate with {lr}{now}, e.g. {lr=:g}", now=now,
                           lr=lr / 5)
    return SettingText("lower the learning rate with {lr}{now}", now=now)


def check_local(results: Sequence[LocalResult], selected: Sequence[int],
                averaged: Mapping[str, Tensor] | None, round_: int, lr: float | None, *,
                secure: bool = False) -> None:
    """Every selected client's training loss and trained model (``LocalResult.state``: its
    state, or a marker holding its first non-finite entry), then the average: the client is
    named where one is at fault, except under ``secure`` (--secagg-updates: the server sees
    the updates' sum alone, so the record names no client; the log does)."""
    for client, r in zip(selected, results, strict=True):
        # under DP-SGD no loss leaves the client (None): the trained model is checked below
        if r.loss is not None and not math.isfinite(float(r.loss)):
            _raise_local(round_, "the local training loss is not finite", client, lr, secure)
    for client, r in zip(selected, results, strict=True):
        bad = nonfinite_key(r.state)
        if bad is not None:
            _raise_local(round_, f"the trained model's {bad} is not finite", client, lr, secure)
    key = nonfinite_key(averaged) if averaged is not None else None
    if key is not None:
        raise Diverged(round_, f"the averaged model's {key} is not finite", hint=lr_hint(lr))


def _raise_local(round_: int, what: str, client: int, lr: float | None, secure: bool) -> None:
    if secure:  # the experimenter's log, never the server's folder
        log.warning("round %d: client %d diverged (%s); the run's record names no client "
                    "under secure aggregation of the updates", round_, client, what)
    raise Diverged(round_, what, client=client, hint=lr_hint(lr), client_public=not secure)


def check_state(state: Mapping[str, Tensor], round_: int, what: str, hint: str) -> None:
    key = nonfinite_key(state)
    if key is not None:
        raise Diverged(round_, f"{what}: {key} is not finite", hint=hint)


def check_payload(payload: Mapping[str, Any], round_: int, label: str) -> None:
    """An aggregated calibration payload (statistics, class gradients)."""
    key = nonfinite_key(payload)
    if key is not None:
        raise Diverged(round_, f"the aggregated {label} upload's {key} is not finite",
                       hint=SettingText("the model's features overflow: lower {lr}, or bound "
                                        "the uploads ({dp_clip})"))


def check_evaluation(ev: Mapping[str, Any], round_: int, lr: float | None) -> None:
    if not (math.isfinite(float(ev["loss"])) and math.isfinite(float(ev["accuracy"]))):
        raise Diverged(round_, f"the test loss is not finite ({ev['loss']})", hint=lr_hint(lr))
