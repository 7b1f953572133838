"""Whose payload is attacked and which of its classes, on a hand-made server view: each
named client's plain upload, or under secure aggregation the aggregate for each of them
(noted); the classes a plain count shows, a class asked for but not visible noted and
skipped. (Class-set inference over a real run is tested in test_runner.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from privfedcal.attacks.reconstruction.runner import Plan
from privfedcal.attacks.reconstruction.stats_attack import StatsOptions
from privfedcal.attacks.reconstruction.uploads import classes_to_attack, sources
from privfedcal.attacks.view import Release, RunView
from privfedcal.calibration.ccvr import CCVR_RELEASE as STATS_LABEL
from privfedcal.errors import UsageError


def _view() -> RunView:
    return RunView(Path("run"), SimpleNamespace(data=SimpleNamespace(clients=3)), {}, None, [])


def _payload(counts) -> dict[str, torch.Tensor]:
    return {"count": torch.tensor(counts, dtype=torch.float64)}


def test_plain_uploads_of_the_named_or_first_clients():
    ups = {0: _payload([1, 0]), 2: _payload([0, 3])}
    rel = Release(1, "x", {}, ups, None, {})
    plan = Plan()
    assert [(c, v) for c, _, v in sources(_view(), rel, None, plan, 2)] == \
        [(0, "plain-upload"), (2, "plain-upload")]
    assert [c for c, _, _ in sources(_view(), rel, [2], plan, 2)] == [2]
    with pytest.raises(UsageError, match=r"client\(s\) \[1\] uploaded nothing"):
        sources(_view(), rel, [1], plan, 2)
    assert plan.notes == []


def test_secure_aggregation_gives_each_client_the_aggregate():
    agg = _payload([1, 3])
    rel = Release(1, "x", {}, {}, agg, {0: 10, 1: 10, 2: 10})
    plan = Plan()
    got = sources(_view(), rel, None, plan, 2)
    assert [(c, v) for c, _, v in got] == [(0, "aggregate"), (1, "aggregate")]
    assert all(p is agg for _, p, _ in got)
    assert "secure aggregation" in plan.notes[0] and "client(s) 0, 1 only" in plan.notes[0]
    with pytest.raises(UsageError, match="out of range"):
        sources(_view(), rel, [5], Plan(), 2)


def test_classes_a_plain_count_shows():
    plan, opts = Plan(), StatsOptions()
    payload = _payload([2, 0, 1])
    assert classes_to_attack(_view(), 0, payload, {"count": 0.0}, None, opts, plan,
                             label=STATS_LABEL) == \
        [(0, True), (2, True)]
    assert classes_to_attack(_view(), 0, payload, {"count": 0.0}, [1, 2], opts, plan,
                             label=STATS_LABEL) == \
        [(2, True)]
    assert plan.notes == ["class 1: not visible in the upload of client 0; skipped"]
    with pytest.raises(UsageError, match="out of range"):
        classes_to_attack(_view(), 0, payload, {"count": 0.0}, [3], opts, plan,
                          label=STATS_LABEL)
