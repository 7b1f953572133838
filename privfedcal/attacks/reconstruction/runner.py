"""Attack a run folder: transcript -> targets -> attacks -> scored records (the generic part).

Threat model: an honest-but-curious server that holds the global model and the run's
transcript (``privacy/transcript.py``): the model state it sent for each release, every
client's plain upload (DP-noised when DP is on), or, under secure aggregation, ciphertext
sizes and the decrypted aggregate only. The planners build targets from that view alone
(``RunView``: ``RUN/server/``); each sits beside its attack, one file per release it
targets (``stats_attack.py``, ``gradients_attack.py``, ``updates_attack.py``; found through
``release_attacks.py`` from the calibrators' release declarations). The clients' data
(``view.truth_exp``, the experimenter's side of the run folder) is used for two things only:
to SCORE the reconstructions, and to build the two hypothetical baselines a server never
sees (raw features of real images, and a model update simulated from a few of a client's
images). Without it (a copy of ``server/`` alone) every attack runs, unscored, and the
baselines are left out with a note. Side knowledge an attack takes beyond the server's view
is named in its record (``needed``, ``class_inferred``).

Here: what a plan is (``Job``, ``Inversion``, ``Plan``), the options every inversion
attack shares (``InversionOptions``; each attack extends them in its own file), and
``execute``, which batches the inversions of a plan, reports its progress in optimisation
steps (``Progress``) and, when interrupted, hands back the targets it finished
(``Stopped``; ``resume.py`` keeps them in a partial attack.json). Scoring is in
``scoring.py``. Every job loads the model state of its release itself, so jobs can run in
any order on the one model object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from privfedcal.attacks.reconstruction.engine import reporting
from privfedcal.attacks.reconstruction.feature_inversion import (
    DEFAULT_ATTACK_BATCH,
    Convergence,
    InversionConfig,
    InversionResult,
    invert_features_many,
    shape_of,
)
from privfedcal.attacks.reconstruction.inversion_options import (  # noqa: F401  (re-exported)
    InversionOptions,
)
from privfedcal.attacks.reconstruction.progress import (  # noqa: F401  (re-exported)
    Progress,
    Stopped,
    Tracker,
    sigterm_interrupts,
)
from privfedcal.attacks.reconstruction.scoring import Attacked, score
from privfedcal.attacks.view import (  # noqa: F401  (re-exported)
    Release,
    RunView,
    UploadedFeatures,
    load_run,
)
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError


def convergence_record(conv: Convergence | None) -> dict[str, Any]:
    return {} if conv is None else conv.as_record()


@dataclass(frozen=True, eq=False)
class Inversion:
    """The inversion a job needs, ready to be batched with others (``execute``): ``solve``
    runs a list of them through ``model`` in ``state`` (loaded through ``view``) and
    returns one result each; inversions with the same solver, model, state, config and
    ``group`` can share a batch. ``images``: images per restart (batches sort by it, for
    less padding). ``key`` names an inversion several jobs share (the aggregate under
    secure aggregation: one inversion, scored once per attacked client)."""

    view: RunView
    model: FeatureClassifier
    state: dict[str, Tensor]
    target: Any
    generator: torch.Generator
    config: InversionConfig
    solve: Callable[[list[Inversion]], list[Any]]
    images: int
    group: Any = ()
    key: Any = None


def solve_features(invs: list[Inversion]) -> list[InversionResult]:
    """Feature inversions of ``FeatureTarget``s, batched (``invert_features_many``)."""
    view = invs[0].view
    view.load_state(invs[0].state)
    d = view.exp.data
    return invert_features_many(invs[0].model, [v.target for v in invs],
                                image_shape=d.x_train.shape[1:], mean=d.mean, std=d.std,
                                generators=[v.generator for v in invs], config=invs[0].config)




#: a job's two halves around its inversion: the inversion, and the scoring of its result
Prepare = Callable[[], tuple[Inversion, Callable[[Any, float], Attacked]]]


@dataclass(frozen=True, eq=False)
class Job:
    """One attack to run; ``target`` and ``base`` (the record's known fields) are kept for
    inspection before running (the FeatureTarget, the class-gradient block, or None).
    ``prepare`` (feature-inversion jobs) lets ``execute`` batch the inversion."""

    description: str
    run: Callable[[], Attacked]
    target: Any = None
    base: dict[str, Any] = field(default_factory=dict)
    prepare: Prepare | None = None


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shared: dict[Any, Any] = field(default_factory=dict)  # aggregate inversions, reused
    attack_batch: int = DEFAULT_ATTACK_BATCH  # targets per batched inversion (execute)


def run_alone(view: RunView, prepare: Prepare, shared: dict[Any, Any]) -> Callable[[], Attacked]:
    """A job's ``run``: its inversion alone (or the shared one), then its scoring."""

    def run() -> Attacked:
        t0 = time.perf_counter()
        inv, finish = prepare()
        res = None if inv.key is None else shared.get(inv.key)
        if res is None:
            (res,) = inv.solve([inv])
            if inv.key is not None:
                shared[inv.key] = res
        return finish(res, time.perf_counter() - t0)

    return run


def inversion_job(view: RunView, opts: InversionOptions, state: dict[str, Tensor], target,
                   truth_idx: Tensor | None, base: dict[str, Any], seed: int, *, paired: bool,
                   extractor: FeatureClassifier | None = None,
                   shared: dict[Any, Any] | None = None) -> Job:
    """``shared`` (with ``base["view"] == "aggregate"``) keeps one inversion of the aggregate
    per (target, class): every attacked client's row scores the same reconstruction."""
    key = (base["target"], base["class"]) if base.get("view") == "aggregate" else None

    def prepare() -> tuple[Inversion, Callable[[InversionResult, float], Attacked]]:
        inv = Inversion(view, extractor or view.model, state, target,
                        make_generator(opts.seed, seed, 0, 61), opts.inversion,
                        solve_features, shape_of(target)[1], group=shape_of(target)[0],
                        key=None if shared is None else key)

        def finish(res: InversionResult, seconds: float) -> Attacked:
            view.load_state(state)
            rec, matched = score(view, res.images, truth_idx, paired=paired)
            record = {**base, **rec, "mode": res.mode, "target_cosine": res.cosine,
                      **convergence_record(res.convergence), "seconds": round(seconds, 3)}
            return Attacked(record, matched, res.images.detach().cpu())

        return inv, finish

    client = "all" if base["client"] is None else base["client"]
    return Job(f"{base['target']} client {client} class {base['class']} (n={base['n']})",
               run_alone(view, prepare, {} if shared is None else shared), target, base,
               prepare)


def size_of(idx: Tensor | None) -> int | None:
    return None if idx is None else int(idx.numel())


def execute(plan: Plan, on_done: Callable[[Job], None] | None = None, *,
            attack_batch: int | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            done: dict[int, Attacked] | None = None) -> list[Attacked]:
    """Run every job of a plan; results in plan order (each job loads the model state it
    needs). Feature inversions through the same model, state and settings are optimised
    together, up to ``attack_batch`` (default ``plan.attack_batch``) targets at a time
    (``invert_features_many``: every target's result is the one it gets alone); 1 runs
    every job on its own.

    ``on_progress`` receives a ``Progress`` (optimisation steps, targets, ETA) as the work
    runs; ``on_done(job)`` after each job. ``done`` (plan index -> result, from a partial
    attack: ``resume.py``) are not run again. A KeyboardInterrupt raises ``Stopped`` with
    every target finished so far; a batch's targets finish together when it ends."""
    size = plan.attack_batch if attack_batch is None else attack_batch
    if size < 1:
        raise SettingError(f"{{attack_batch}} must be >= 1, got {size}")
    out: dict[int, Attacked] = dict(done or {})
    tracker = Tracker(len(plan.jobs), len(out), on_progress)

    def finished(i: int, result: Attacked) -> None:
        out[i] = result
        tracker.target_done()
        if on_done is not None:
            on_done(plan.jobs[i])

    try:
        with reporting(tracker):
            _run(plan, [i for i in range(len(plan.jobs)) if i not in out], size, tracker,
                 finished)
            tracker.unit("")
    except KeyboardInterrupt:
        raise Stopped(out, len(plan.jobs)) from None
    return [out[i] for i in range(len(plan.jobs))]


def _run(plan: Plan, todo: list[int], size: int, tracker: Tracker,
         finished: Callable[[int, Attacked], None]) -> None:
    """``execute``'s work: prepare the jobs, plan the total, run the lone jobs, then the
    batches of each group."""
    alone = [i for i in todo if plan.jobs[i].prepare is None]
    prepared = {i: prep() for i in todo if (prep := plan.jobs[i].prepare) is not None}
    groups: dict[Any, list[int]] = {}
    for i, (inv, _) in prepared.items():
        group = (inv.solve, id(inv.model), id(inv.state), inv.config, inv.group)
        groups.setdefault(group, []).append(i)
    # one inversion per shared key; similar image counts together (less padding)
    batches: list[tuple[list[int], dict[int, list[int]]]] = []
    for members in groups.values():
        followers: dict[int, list[int]] = {}
        source: dict[Any, int] = {}
        for i in members:
            src = source.setdefault(prepared[i][0].key if prepared[i][0].key is not None
                                    else i, i)
            followers.setdefault(src, []).append(i)
        unique = sorted(followers, key=lambda i: prepared[i][0].images)
        for chunk in _chunks(unique, [prepared[i][0].images for i in unique], size):
            batches.append((chunk, followers))

    def work(chunk: list[int]) -> tuple[int, int]:
        """Planned (restart-steps, image-steps) of the inversions ``chunk``."""
        steps = [prepared[i][0].config.steps * prepared[i][0].config.restarts for i in chunk]
        return sum(steps), sum(n * prepared[i][0].images for n, i in zip(steps, chunk,
                                                                         strict=True))

    planned = [work(chunk) for chunk, _ in batches]
    tracker.plan(sum(p[0] for p in planned), sum(p[1] for p in planned))
    for i in alone:
        tracker.unit(plan.jobs[i].description)
        finished(i, plan.jobs[i].run())
    for chunk, followers in batches:
        more = f" and {len(chunk) - 1} more" if len(chunk) > 1 else ""
        tracker.unit(plan.jobs[chunk[0]].description + more, *work(chunk))
        t0 = time.perf_counter()
        many = prepared[chunk[0]][0].solve([prepared[i][0] for i in chunk])
        share = (time.perf_counter() - t0) / len(chunk)  # "seconds": a share of the batch
        for src, res in zip(chunk, many, strict=True):
            for i in followers[src]:
                finished(i, prepared[i][1](res, share))


#: a batch's per-step overhead in images' worth of compute: a target joins the batch while
#: the padding it adds costs less than this (a heuristic, not a measured constant)
CHUNK_OVERHEAD_IMAGES = 64


def _chunks(order: list[int], images: list[int], size: int) -> list[list[int]]:
    """Split ``order`` (sorted by image count, ``images`` in the same order) into batches of
    at most ``size`` targets, starting a new batch where padding every earlier target up
    to the next one's image count would cost more than another batch's overhead."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    widest = 0
    for i, n in zip(order, images, strict=True):
        if cur and (len(cur) >= size or len(cur) * (n - widest) > CHUNK_OVERHEAD_IMAGES):
            chunks.append(cur)
            cur = []
        cur.append(i)
        widest = n
    return chunks + [cur] if cur else chunks

