"""Run one schedule: train with its fault injected (the simulator, or the real Flower apps
over the in-process grid), resume a stopped run with the package's own resume, extend a
finished one, snapshot ``server/`` after every process, and check the invariants on what
the server ever held. The package is imported here only to run training."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .accounting import charged
from .inject import NanLoss, NanUpload, Refuse, Stop, lossy_grid, patched, seam
from .invariants import Violation, isolation
from .schedule import Schedule
from .schema import records, timing
from .view import ServerView, merge, snapshot

BASE = dict(dataset="digits", local_epochs=1, batch_size=32, device="cpu", threads=1,
            transcript=True)


@dataclass
class Outcome:
    schedule: Schedule
    events: list[str] = field(default_factory=list)  # what happened, in order
    view: ServerView | None = None
    violations: list[Violation] = field(default_factory=list)


def check(view: ServerView, observers: tuple[int, ...] = ()) -> list[Violation]:
    """Every invariant on one server view."""
    return isolation(view, observers) + charged(view) + records(view) + timing(view)


def config(settings: dict[str, Any], out: Path):
    from privfedcal.settings.run_config import RunConfig

    return RunConfig.of(**{**BASE, **settings, "out": str(out)})


def injection(fault: dict[str, Any]):
    """The context manager that injects ``fault`` into a simulator run, and its probe."""
    kind = fault.get("kind")
    if kind == "stop" and fault["seam"] == "release":
        probe: Any = Stop(fault["nth"], fault["when"],
                          match=lambda self, **kw: kw.get("view") == "aggregate")
        return patched(*seam("record"), probe), probe
    if kind == "stop":
        probe = Stop(fault["nth"], fault["when"])
        return patched(*seam(fault["seam"]), probe), probe
    if kind == "nan-upload":
        probe = NanUpload(fault["nth"])
        return patched(*seam("client_side"), probe), probe
    if kind == "refuse":
        probe = Refuse(fault["nth"])
        return patched(*seam("admit"), probe), probe
    if kind == "nan-loss":
        import privfedcal.federation.simulator as simulator

        probe = NanLoss(fault["nth"])
        return patched(simulator.Simulator, "receive_updates", probe), probe
    return contextlib.nullcontext(), None


def attempt(out: Outcome, name: str, call) -> bool:
    """Run ``call``; record how it ended. True when it finished."""
    from privfedcal.errors import Diverged, PrivacyBudgetError, UsageError

    try:
        from privfedcal.flower.link import FlowerRoundError
    except ImportError:  # no flower extra: no Flower run either
        FlowerRoundError = Diverged  # noqa: N806 - stands in for the missing class

    try:
        call()
    except KeyboardInterrupt:
        out.events.append(f"{name}: stopped")
    except (UsageError, PrivacyBudgetError) as exc:
        out.events.append(f"{name}: refused ({type(exc).__name__})")
    except Diverged:
        out.events.append(f"{name}: diverged")
    except FlowerRoundError:
        out.events.append(f"{name}: too few replies")
    else:
        out.events.append(f"{name}: finished")
        return True
    return False


def run_simulator(schedule: Schedule, run: Path, out: Outcome) -> list[ServerView]:
    from privfedcal.api import resume, train

    cfg = None

    def build():
        nonlocal cfg
        cfg = config(schedule.settings, run)

    views: list[ServerView] = []
    if not attempt(out, "config", build):
        return views
    inject, _ = injection(schedule.fault)
    with inject:
        done = attempt(out, "train", lambda: train(cfg, progress=False))
    if (run / "server" / "config.json").is_file():
        views.append(snapshot(run / "server"))
    if out.events[-1].endswith("stopped"):
        done = attempt(out, "resume", lambda: resume(run, progress=False))
        views.append(snapshot(run / "server"))
    if done and schedule.fault.get("kind") == "extend":
        more = cfg.training.rounds + int(schedule.fault["more"])
        attempt(out, "extend", lambda: resume(run, rounds=more, progress=False))
        views.append(snapshot(run / "server"))
    return views


def run_flower(schedule: Schedule, run: Path, out: Outcome, min_replies: int | None = None,
               match=None) -> list[ServerView]:
    """The real ServerApp and ClientApps over the in-process grid, one node lost."""
    from flwr.app import Context, RecordDict

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.flower.server_app import run_server

    cfg = config(schedule.settings, run)
    f = schedule.fault
    if min_replies is None:  # one node may be lost from a round
        min_replies = max(1, int(cfg.data.clients * cfg.training.participation) - 1)
    options = FlowerOptions(round_timeout=1.5, poll_interval=0.05, node_wait=2.0,
                            min_replies=min_replies)
    run_config = to_run_config(cfg.replace(data_seed=None), options)
    grid = lossy_grid(client_app, run_config, cfg.data.clients, {"data-seed": cfg.training.data_seed},
                      victim=int(f["victim"]), nth=int(f["nth"]), reply=f["reply"],
                      match=match)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                  run_config=run_config)
    attempt(out, "flower", lambda: run_server(grid, ctx))
    out.events.append(f"lost: {grid.hit}")
    if not (run / "server" / "config.json").is_file():
        return []
    view = snapshot(run / "server")
    view.settings = {k: v for k, v in run_config.items() if k.startswith("flower.")}
    return [view]


def run_schedule(schedule: Schedule, root: Path, **flower: Any) -> Outcome:
    """Run ``schedule`` in ``root`` and check what the server held."""
    out = Outcome(schedule)
    run = Path(root) / f"run-{schedule.seed}"
    if schedule.engine == "flower":
        views = run_flower(schedule, run, out, **flower)
    else:
        views = run_simulator(schedule, run, out)
    if views:
        out.view = merge(views)
        # under Flower a client node holds the CKKS key and sees every decrypted sum
        holder = out.view.settings.get("flower.key-holder")
        out.violations = check(out.view, () if holder is None else (int(holder),))
    return out
