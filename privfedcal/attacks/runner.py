"""Attack a run folder: transcript -> targets -> attacks -> scored records.

Threat model: an honest-but-curious server that holds the global model and the run's
transcript (``privacy/transcript.py``): the model state it sent for each release, every
client's plain upload (DP-noised when DP is on), or, under secure aggregation, ciphertext
sizes and the decrypted aggregate only. The planners below build targets from that view
alone (``RunView``: ``RUN/server/``). The clients' data (``view.truth_exp``, the
experimenter's side of the run folder) is used for two things only: to SCORE the
reconstructions, and to build the two hypothetical baselines a server never sees (raw
features of real images, and a model update simulated from a few of a client's images).
Without it (a copy of ``server/`` alone) every attack runs, unscored, and the baselines are
left out with a note. Side knowledge an attack takes beyond the server's view is named in
its record (``needed``, ``class_inferred``).

Scoring is in ``report.py``. Every job loads the model state of its release itself, so
jobs can run in any order on the one model object.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.attacks.class_inference import infer_classes, score_class_sets
from privfedcal.attacks.feature_inversion import (
    DEFAULT_ATTACK_BATCH,
    DEFAULT_MAX_STEPS,
    Convergence,
    FeatureTarget,
    InversionConfig,
    InversionResult,
    invert_features_many,
    shape_of,
)
from privfedcal.attacks.gradient_inversion import (
    gradient_rank,
    recover_from_class_gradient,
    recover_rank_n,
    split_class_gradient,
)
from privfedcal.attacks.model_updates import LocalRecipe, invert_model_update, invert_update
from privfedcal.attacks.rounds import invert_class_gradients_many
from privfedcal.attacks.report import Attacked, score
from privfedcal.attacks.view import (  # noqa: F401  (re-exported)
    GRAD_LABEL,
    STATS_LABEL,
    Release,
    RunView,
    UploadedFeatures,
    load_run,
)
from privfedcal.errors import UsageError
from privfedcal.models.base import FeatureClassifier
from privfedcal.privacy.releases import ROUND_RECORD, UPDATE_RELEASE
from privfedcal.seeding import make_generator


@dataclass(frozen=True)
class AttackOptions:
    """What to attack and how hard. ``raw_samples=0`` drops the raw-feature baseline."""

    steps: int = DEFAULT_MAX_STEPS  # cap; inversions stop at convergence (InversionConfig)
    restarts: int = 4
    raw_samples: int = 3  # real images per (client, class) for the raw-feature baseline
    max_n: int = 256  # class-stats batches above this many images are skipped (noted)
    update_batch: int = 4  # local batch of the simulated model update
    rank_max: int = 3  # largest n for rank-n feature recovery from a class gradient
    rounds_combined: int = 3  # CReFF releases whose class gradients are inverted together
    default_clients: int = 2  # clients attacked when none are named (the first uploaders)
    known_classes: bool = False  # also attack held classes the upload hides (side knowledge)
    round: int | None = None  # release round to attack; None: the last one
    seed: int = 0
    false_positive_rate: float = 1e-3  # class inference under DP noise
    # feature inversions optimised together per batch (engine.py); 1: one at a time
    attack_batch: int = DEFAULT_ATTACK_BATCH

    def __post_init__(self) -> None:
        # 0 steps would score the random start as the attack's result ("nothing leaked")
        if self.steps < 1 or self.restarts < 1:
            raise UsageError(f"attacks need --steps >= 1 and --restarts >= 1 (got --steps "
                             f"{self.steps}, --restarts {self.restarts}): with none the random "
                             "start would be reported as the attack's result")
        if self.raw_samples < 0 or self.max_n < 1 or self.update_batch < 1:
            raise UsageError("need --raw-samples >= 0, --max-n >= 1 and --update-batch >= 1")
        if self.rounds_combined < 1:
            raise UsageError("--rounds-combined must be >= 1 (1: one release at a time)")
        if self.default_clients < 1:
            raise UsageError("at least one client must be attacked")
        if self.attack_batch < 1:
            raise UsageError(f"--attack-batch must be >= 1 (1: one target at a time), got "
                             f"{self.attack_batch}")
        if not 0 < self.false_positive_rate < 1:
            raise UsageError("the false-positive rate must be in (0, 1)")

    @property
    def inversion(self) -> InversionConfig:
        return InversionConfig(steps=self.steps, restarts=self.restarts)


def _convergence(conv: Convergence | None) -> dict[str, Any]:
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


def _solve_features(invs: list[Inversion]) -> list[InversionResult]:
    """Feature inversions of ``FeatureTarget``s, batched (``invert_features_many``)."""
    view = invs[0].view
    view.load_state(invs[0].state)
    d = view.exp.data
    return invert_features_many(invs[0].model, [v.target for v in invs],
                                image_shape=d.x_train.shape[1:], mean=d.mean, std=d.std,
                                generators=[v.generator for v in invs], config=invs[0].config)


def _solve_rounds(invs: list[Inversion]) -> list[Any]:
    """Class gradients across rounds (``invert_class_gradients_many``); every target is
    ``(states, heads, blocks, label, n)`` of the same releases (``group``)."""
    view = invs[0].view
    view.load_state(invs[0].state)
    d = view.exp.data
    states, heads = invs[0].target[:2]
    return invert_class_gradients_many(
        invs[0].model, states, heads, [v.target[2:] for v in invs],
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


def _single(view: RunView, prepare: Prepare, shared: dict[Any, Any]) -> Callable[[], Attacked]:
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


def _inversion_job(view: RunView, opts: AttackOptions, state: dict[str, Tensor], target,
                   truth_idx: Tensor, base: dict[str, Any], seed: int, *, paired: bool,
                   extractor: FeatureClassifier | None = None,
                   shared: dict[Any, Any] | None = None) -> Job:
    """``shared`` (with ``base["view"] == "aggregate"``) keeps one inversion of the aggregate
    per (target, class): every attacked client's row scores the same reconstruction."""
    key = (base["target"], base["class"]) if base.get("view") == "aggregate" else None

    def prepare() -> tuple[Inversion, Callable[[InversionResult, float], Attacked]]:
        inv = Inversion(view, extractor or view.model, state, target,
                        make_generator(opts.seed, seed, 0, 61), opts.inversion,
                        _solve_features, shape_of(target)[1], group=shape_of(target)[0],
                        key=None if shared is None else key)

        def finish(res: InversionResult, seconds: float) -> Attacked:
            view.load_state(state)
            rec, matched = score(view, res.images, truth_idx, paired=paired)
            record = {**base, **rec, "mode": res.mode, "target_cosine": res.cosine,
                      **_convergence(res.convergence), "seconds": round(seconds, 3)}
            return Attacked(record, matched, res.images.detach().cpu())

        return inv, finish

    client = "all" if base["client"] is None else base["client"]
    return Job(f"{base['target']} client {client} class {base['class']} (n={base['n']})",
               _single(view, prepare, {} if shared is None else shared), target, base,
               prepare)


# ---- sources: per-client uploads, or the aggregate under secure aggregation -------------------
def _sources(view: RunView, rel: Release, clients: Sequence[int] | None, plan: Plan,
             default_clients: int) -> list[tuple[int, dict[str, Tensor], str]]:
    """``(client, payload, view)`` per attacked client. Under secure aggregation every
    attacked client gets the aggregate as payload: the reconstruction is then scored
    against that client's images, exactly as its plain upload would be (report.score)."""
    if rel.uploads:
        seen = sorted(rel.uploads)
        chosen = list(clients) if clients else seen[:default_clients]
        missing = [c for c in chosen if c not in rel.uploads]
        if missing:
            raise UsageError(f"client(s) {missing} uploaded nothing in round {rel.round}; "
                             f"clients with uploads: {', '.join(map(str, seen))}")
        return [(c, rel.uploads[c], "plain-upload") for c in chosen]
    senders = sorted(rel.ciphertext_bytes) or list(range(view.cfg.clients))
    chosen = list(clients) if clients else senders[:default_clients]
    bad = [c for c in chosen if not 0 <= c < view.cfg.clients]
    if bad:
        raise UsageError(f"client(s) {bad} out of range 0..{view.cfg.clients - 1}")
    plan.notes.append(f"secure aggregation: round {rel.round} has no per-client uploads "
                      f"({len(rel.ciphertext_bytes)} ciphertexts); attacking the aggregate (the "
                      "statistics of the whole federation) and scoring it against the images "
                      f"of client(s) {', '.join(map(str, chosen))} only, like the per-client "
                      "rows")
    return [(c, rel.aggregate, "aggregate") for c in chosen]


def _classes(view: RunView, client: int | None, payload: dict[str, Tensor], stds: dict,
             wanted: Sequence[int] | None, opts: AttackOptions,
             plan: Plan) -> list[tuple[int, bool]]:
    """``(class, inferred)`` pairs to attack: classes the upload shows present (and the
    client holds: a false positive cannot be scored), plus, with ``known_classes``, held
    classes the upload hides (``inferred`` False: the attacker's side knowledge)."""
    present, _ = infer_classes(payload, noise_std=stds,
                               false_positive_rate=opts.false_positive_rate)
    who = "the federation" if client is None else f"client {client}"
    if opts.known_classes and not view.scored:
        plan.notes.append("--known-classes needs the clients' class sets (the experimenter's "
                          "side of the run folder): not available here")
    out = []
    for c in (wanted if wanted else range(present.shape[-1])):
        if not 0 <= c < present.shape[-1]:
            raise UsageError(f"class {c} out of range 0..{present.shape[-1] - 1}")
        truth = view.truth(client, c)
        held = None if truth is None else truth.numel() > 0  # None: unknown (unscored)
        if bool(present[c]) and held is False:
            # without DP noise a class can only look present when the upload is an
            # aggregate that another client's data is in
            noisy = any(s > 0 for s in stds.values())
            why = "DP noise" if noisy else "another client's class in the aggregate"
            plan.notes.append(f"class {c} looks present for {who} ({why}) but is not held: "
                              "a false positive, nothing to reconstruct")
        elif bool(present[c]) or (held and opts.known_classes):
            out.append((c, bool(present[c])))
        elif wanted:
            plan.notes.append(f"class {c}: not visible in the upload of {who}; skipped")
    if not bool(present.any()):
        plan.notes.append(f"no class is detectably present in the upload of {who} (noise): "
                          + ("attacking its held classes as side knowledge"
                             if opts.known_classes else "nothing to invert (see --known-classes)"))
    return out


def plan_stats(view: RunView, opts: AttackOptions, clients: Sequence[int] | None = None,
               classes: Sequence[int] | None = None) -> Plan:
    """Raw-feature baseline, class-mean and class-stats inversion of a CCVR release."""
    from privfedcal.calibration.stats import ClassStats
    from privfedcal.privacy.dp import noisy_stats_to_moments

    plan, rel = Plan(attack_batch=opts.attack_batch), view.release(STATS_LABEL, opts.round)
    extractor = view.stats_extractor()
    for client, payload, seen in _sources(view, rel, clients, plan, opts.default_clients):
        stds = view.noise_stds(STATS_LABEL, list(payload))
        noisy = any(s > 0 for s in stds.values())
        if noisy:
            count, mean, cov = noisy_stats_to_moments(payload["count"], payload["sum"],
                                                      payload["outer"])
        else:
            st = ClassStats.from_payload(dict(payload))
            count, mean, cov = st.count, st.mean(), st.covariance()
        for c, inferred in _classes(view, client, payload, stds, classes, opts, plan):
            truth = view.truth(client, c)
            n = max(1, int(round(float(count[c]))))
            base = {"client": client, "class": c, "round": rel.round, "view": seen,
                    "dp": noisy, "n_true": _size(truth), "class_inferred": inferred}
            tag = c + 1000 * client
            agg_tag = c + 1000 * 999 if seen == "aggregate" else tag
            if opts.raw_samples and truth is None:
                plan.notes.append("no raw-feature baseline: it needs the clients' images (the "
                                  "experimenter's side of the run folder); attacks run unscored")
            elif opts.raw_samples:
                g = make_generator(opts.seed, tag, 0, 62)
                pick = truth[torch.randperm(truth.numel(), generator=g)[:opts.raw_samples]
                             .to(truth.device)]
                with torch.no_grad():
                    view.load_state(rel.state)
                    z = extractor.features(view.truth_exp.data.x_train[pick]).detach()
                plan.jobs.append(_inversion_job(
                    view, opts, rel.state, FeatureTarget.raw(z), pick,
                    {**base, "target": "raw-feature", "n": 1, "view": "hypothetical",
                     "dp": False, "images": int(pick.numel())}, tag * 4, paired=True,
                    extractor=extractor))
            m = mean[c].float()
            plan.jobs.append(_inversion_job(
                view, opts, rel.state, FeatureTarget.class_mean(m, n), truth,
                {**base, "target": "class-mean", "n": n}, agg_tag * 4 + 1, paired=False,
                extractor=extractor, shared=plan.shared))
            if n > opts.max_n:
                plan.notes.append(f"class-stats of class {c} ({n} samples) skipped: above "
                                  f"--max-n {opts.max_n}")
                continue
            plan.jobs.append(_inversion_job(
                view, opts, rel.state, FeatureTarget.class_stats(n, m, cov[c].float()), truth,
                {**base, "target": "class-stats", "n": n}, agg_tag * 4 + 2, paired=False,
                extractor=extractor, shared=plan.shared))
    return plan


def _size(idx: Tensor | None) -> int | None:
    return None if idx is None else int(idx.numel())


def creff_head(view: RunView, rel: Release) -> tuple[Tensor, Tensor | None] | None:
    """The head (W, b) the clients differentiated in a CReFF release: the one the server sent
    with it (``Release.task``, recorded with every release). Transcripts written before the
    head was recorded pin it only in the first release of a run with
    ``initial_head="global"`` (the sent state's classifier); else None."""
    from privfedcal.calibration.creff import CReFFParams
    from privfedcal.calibration.retrain import effective_weight, read_head

    if "head.weight" in rel.task:
        b = rel.task.get("head.bias")
        return rel.task["head.weight"].double(), None if b is None else b.double()
    first = min((r.round for r in view.releases(GRAD_LABEL)), default=None)
    initial = view.cfg.calibration_params.get(
        "initial_head", getattr(CReFFParams, "initial_head", "global"))
    if rel.state is None or rel.round != first or initial != "global":
        return None
    head = read_head(rel.state)
    return effective_weight(head.weight.double(), head.normalized), (
        None if head.bias is None else head.bias.double())


def _gradient_job(view: RunView, opts: AttackOptions, state: dict[str, Tensor], block: Tensor,
                  truth_idx: Tensor, base: dict[str, Any], seed: int,
                  head: tuple[Tensor, Tensor | None] | None = None,
                  n_known: int | None = None) -> Job:
    """Class-gradient attack: with the head known and n <= ``opts.rank_max`` (n from the
    uploaded count, else the gradient's rank when below C - 1) the n features are recovered
    exactly (``recover_rank_n``) and inverted as a batch; otherwise the least-squares
    weighted-mean feature is inverted to one image."""

    def prepare() -> tuple[Inversion, Callable[[InversionResult, float], Attacked]]:
        view.load_state(state)
        gw, gb = split_class_gradient(block.to(view.exp.device).float())
        z, info = recover_from_class_gradient(gw, gb)
        rank = gradient_rank(gw)
        n_est = n_known if n_known is not None else (rank if rank < gw.shape[0] - 1 else None)
        extra: dict[str, Any] = {"gradient_rank": rank, "n_used": n_est}
        if head is not None and n_est is not None and 1 <= n_est <= opts.rank_max:
            rn = recover_rank_n(block.to(view.exp.device).double(), head[0], head[1],
                                int(info.label), n_est,
                                generator=make_generator(opts.seed, seed, 0, 67))
            target, how = FeatureTarget.raw(rn.features.float()), "rank-n+"
            extra.update(rank_n_residual=rn.residual,
                         needed=["the head the client used", "n (count or gradient rank)"])
        else:  # the least-squares weighted-mean feature, one image
            target, how = FeatureTarget.raw(z.reshape(-1, z.shape[-1])), "analytic+"
            extra["needed"] = ["the class gradient only"]
        inv = Inversion(view, view.model, state, target, make_generator(opts.seed, seed, 0, 63),
                        opts.inversion, _solve_features, shape_of(target)[1],
                        group=shape_of(target)[0])

        def finish(res: InversionResult, seconds: float) -> Attacked:
            view.load_state(state)
            rec, matched = score(view, res.images, truth_idx, paired=False)
            label = int(info.label)
            record = {**base, **rec, "mode": how + res.mode, "target_cosine": res.cosine,
                      "recovered_label": label, "label_correct": label == base["class"],
                      "fit_residual": float(info.residual),
                      "single_sample": bool(info.single_sample),
                      **extra, **_convergence(res.convergence), "seconds": round(seconds, 3)}
            return Attacked(record, matched, res.images.detach().cpu())

        return inv, finish

    client = "all" if base["client"] is None else base["client"]
    return Job(f"class-gradient client {client} class {base['class']} (n={base['n']})",
               _single(view, prepare, {}), block, base, prepare)


def _update_job(view: RunView, opts: AttackOptions, rel: Release, client: int) -> Job:
    """The server's view of one local SGD step (lr of the run, plain cross-entropy, train
    mode) on ``update_batch`` of the client's images, then Geiping et al.'s inversion."""

    def run() -> Attacked:
        t0 = time.perf_counter()
        d, model = view.truth_exp.data, view.model
        idx = view.truth_exp.parts[client]
        g = make_generator(opts.seed, client, rel.round, 64)
        pick = idx[torch.randperm(idx.numel(), generator=g)[:opts.update_batch].to(idx.device)]
        view.load_state(rel.state)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        model.train()  # the client's own step: batch statistics, as in local training
        try:
            loss = F.cross_entropy(model(d.x_train[pick]), d.y_train[pick])
            grads = torch.autograd.grad(loss, [p for _, p in named])
        finally:
            view.load_state(rel.state)  # undo running-statistics updates; back to eval mode
        update = {n: -view.cfg.lr * gr.detach() for (n, _), gr in zip(named, grads, strict=True)}
        res = invert_update(model, update, batch_size=int(pick.numel()), kind="update",
                            image_shape=d.x_train.shape[1:], mean=d.mean, std=d.std,
                            generator=make_generator(opts.seed, client, rel.round, 65),
                            steps=opts.steps, restarts=opts.restarts)
        rec, matched = score(view, res.images, pick, paired=False)
        record = {"target": "model-update", "client": client, "class": None,
                  "n": int(pick.numel()), "round": rel.round, "view": "simulated-update",
                  "dp": False, "labels": sorted(d.y_train[pick].tolist()),
                  "recovered_labels": res.labels.tolist(), **rec, "mode": "update",
                  "target_cosine": res.gradient_cosine,
                  "seconds": round(time.perf_counter() - t0, 3)}
        return Attacked(record, matched, res.images.detach().cpu())

    return Job(f"model-update client {client} (batch {opts.update_batch})", run, None,
               {"target": "model-update", "client": client, "round": rel.round})


def plan_gradients(view: RunView, opts: AttackOptions, clients: Sequence[int] | None = None,
                   classes: Sequence[int] | None = None, *, updates: bool = False,
                   gradients: bool = True) -> Plan:
    """Analytic + feature inversion of CReFF class gradients; with ``updates``, inversion of
    a simulated local model update of each attacked client (model updates are never
    encrypted, so this works under secure aggregation too)."""
    plan = Plan(attack_batch=opts.attack_batch)
    has_grad = any(e["label"] == GRAD_LABEL for e in view.entries)
    if gradients and (has_grad or not updates):
        rel = view.release(GRAD_LABEL, opts.round)
        head = creff_head(view, rel)
        if head is None:
            plan.notes.append(f"class gradients of round {rel.round}: the head CReFF sent is "
                              "not in the transcript (written before heads were recorded), "
                              "so no rank-n recovery (weighted-mean features); only the first "
                              "release of a run with initial_head=global uses the sent "
                              "model's head")
        for client, payload, seen in _sources(view, rel, clients, plan, opts.default_clients):
            stds = view.noise_stds(GRAD_LABEL, list(payload))
            noisy = any(s > 0 for s in stds.values())
            for c, inferred in _classes(view, client, payload, stds, classes, opts, plan):
                truth = view.truth(client, c)
                n_obs = float(payload["count"][c]) if "count" in payload else None
                n_shown = _size(truth) if truth is not None else (
                    max(1, int(round(n_obs))) if n_obs is not None else 0)
                base = {"target": "class-gradient", "client": client, "class": c,
                        "n": n_shown, "n_observed": n_obs, "round": rel.round,
                        "view": seen, "dp": noisy, "n_true": _size(truth),
                        "class_inferred": inferred}
                tag = c + 1000 * client + 10**6 * rel.round
                n_known = (max(1, int(round(n_obs))) if n_obs is not None and not noisy
                           else None)
                block = payload["grad"][c]  # a sum under sample weighting: make it a mean
                block = block / max(n_obs, 1.0) if n_obs is not None else block
                plan.jobs.append(_gradient_job(view, opts, rel.state, block, truth,
                                               base, tag, head=None if noisy else head,
                                               n_known=n_known))
        if opts.rounds_combined > 1:
            _plan_rounds(view, opts, rel, clients, classes, plan)
    if updates and updates_aggregated(view):
        # no simulated update either: it would stand in for an upload the server never saw
        message = (f"the model updates of {view.run_dir} were securely aggregated "
                   "(--secagg-updates): there is no per-client update to attack, only the "
                   "aggregate of every participant's")
        if not plan.jobs:
            raise UsageError(message)
        plan.notes.append(message)
        return plan
    if updates:
        recorded = plan_updates(view, opts, clients)
        if recorded.jobs:
            plan.jobs += recorded.jobs
            plan.notes += recorded.notes
            return plan
        plan.notes += recorded.notes
        if not has_grad:
            plan.notes.append("no class gradients in this transcript (not a CReFF run): "
                              "attacking model updates only")
        labels = sorted({e["label"] for e in view.entries if e["view"] == "model-state"})
        rel = view.release(GRAD_LABEL if has_grad else labels[-1], opts.round)
        chosen = list(clients) if clients else [0]  # one client's update by default
        for c in chosen:
            if not 0 <= c < view.cfg.clients:
                raise UsageError(f"client {c} out of range 0..{view.cfg.clients - 1}")
            if not view.scored:
                plan.notes.append("no simulated model update: it needs a client's images (the "
                                  "experimenter's side of the run folder)")
                continue
            plan.jobs.append(_update_job(view, opts, rel, c))
    return plan


def _plan_rounds(view: RunView, opts: AttackOptions, last: Release,
                 clients: Sequence[int] | None, classes: Sequence[int] | None,
                 plan: Plan) -> None:
    """One job per attacked (client, class) that combines the client's class gradients of
    up to ``opts.rounds_combined`` releases ending at ``last`` (each with the model state
    and head the server sent; ``invert_class_gradients``). Only plain, noise-free uploads
    with a recorded head; n from the uploaded count, else from the gradient's rank when
    below C - 1, else not attacked (noted)."""
    rels = [r for r in view.releases(GRAD_LABEL) if r.round <= last.round and r.uploads
            and r.state is not None and "head.weight" in r.task][-opts.rounds_combined:]
    if len(rels) < 2 or any(s > 0 for s in view.noise_stds(GRAD_LABEL, ["grad"]).values()):
        return
    chosen = list(clients) if clients else sorted(last.uploads)[:opts.default_clients]
    for client in chosen:
        having = [r for r in rels if client in r.uploads]
        if len(having) < 2:
            continue
        payload = having[-1].uploads[client]
        present = torch.nonzero(payload["grad"].flatten(1).abs().sum(1) > 0).flatten().tolist()
        for c in present if classes is None else [c for c in classes if c in present]:
            truth = view.truth(client, c)
            if truth is not None and truth.numel() == 0:
                continue
            blocks = []
            for r in having:
                up = r.uploads[client]
                cnt = float(up["count"][c]) if "count" in up else None
                blocks.append(up["grad"][c] / max(cnt, 1.0) if cnt is not None
                              else up["grad"][c])
            if "count" in payload:
                n_est: int | None = max(1, int(round(float(payload["count"][c]))))
            else:
                rank = gradient_rank(split_class_gradient(blocks[-1].double())[0])
                n_est = rank if rank < view.exp.data.num_classes - 1 else None
            if n_est is None or n_est > opts.max_n:
                plan.notes.append(f"class gradients across rounds, client {client} class {c}: "
                                  "n unknown (no count uploaded, gradient of full rank) or "
                                  "above --max-n; not attacked")
                continue
            base = {"target": "class-gradient-rounds", "client": client, "class": c,
                    "n": _size(truth) if truth is not None else n_est, "n_used": n_est,
                    "round": last.round, "rounds": [r.round for r in having],
                    "view": "plain-upload", "dp": False, "n_true": _size(truth),
                    "class_inferred": True}
            plan.jobs.append(_rounds_job(view, opts, having, blocks, truth, base,
                                         c + 1000 * client + 10**6 * last.round + 7))


def _rounds_job(view: RunView, opts: AttackOptions, rels: list[Release], blocks: list[Tensor],
                truth_idx: Tensor, base: dict[str, Any], seed: int) -> Job:
    def prepare() -> tuple[Inversion, Callable[[Any, float], Attacked]]:
        heads = [creff_head(view, r) for r in rels]
        target = ([r.state for r in rels], heads, blocks, base["class"], base["n_used"])
        inv = Inversion(view, view.model, rels[-1].state, target,
                        make_generator(opts.seed, seed, 0, 68),
                        dataclasses.replace(opts.inversion, restarts=1, tv_weight=1e-2,
                                            l2_weight=0.0, jitter=0, bn_weight=0.0),
                        _solve_rounds, base["n_used"], group=tuple(r.round for r in rels))

        def finish(res: Any, seconds: float) -> Attacked:
            view.load_state(rels[-1].state)
            rec, matched = score(view, res.images, truth_idx, paired=False)
            record = {**base, **rec, "mode": "class-gradients-across-rounds",
                      "target_cosine": res.gradient_cosine, **_convergence(res.convergence),
                      "needed": ["the model state and head sent in every combined round",
                                 "n (count or gradient rank)",
                                 "the same samples in every round (n within CReFF's per-class "
                                 "draw cap)"],
                      "seconds": round(seconds, 3)}
            return Attacked(record, matched, res.images.detach().cpu())

        return inv, finish

    return Job(f"class gradients client {base['client']} class {base['class']} rounds "
               f"{','.join(map(str, base['rounds']))} (n={base['n']})", _single(view, prepare, {}),
               blocks, base, prepare)


UPDATE_LABEL, ROUND_LABEL = UPDATE_RELEASE, ROUND_RECORD


def _recorded_update_job(view: RunView, opts: AttackOptions, round_: int,
                         start: dict[str, Tensor], entry: dict[str, Any]) -> Job:
    """Invert one client's recorded model update (labels first, multi-step local training
    simulated with the recorded recipe; ``model_updates.invert_model_update``)."""
    client = int(entry["client"])
    cfg = view.cfg
    recipe = LocalRecipe(epochs=int(entry.get("local_epochs", cfg.local_epochs)),
                         batch_size=int(entry.get("batch_size", cfg.batch_size)),
                         lr=float(entry.get("lr", cfg.lr)), momentum=float(cfg.momentum),
                         weight_decay=float(cfg.weight_decay))
    weight = entry.get("weight")
    truth = view.client_indices(client)
    # Under --dp-train the server averages with uniform public weights (1 per client): the
    # weight is no sample count, and inverting one image would under-report the leak.
    dp_sgd = bool(getattr(cfg, "dp_train", False))
    n_from_weight = weight is not None and float(weight) >= 1 and not dp_sgd
    if n_from_weight:
        n, how = int(round(float(weight))), "n = aggregation weight"
    elif truth is not None:
        n, how = int(truth.numel()), ("n = the client's sample count (side knowledge: no "
                                      "sample-count weight seen)")
    else:  # no weight, no side knowledge: guess one local batch (public recipe)
        n, how = recipe.batch_size, "n = one local batch (a guess: no sample count seen)"
    needed = ["global state of the round", "the client's state after local training",
              "recipe (local_epochs, batch_size, lr; momentum, weight_decay from config.json)",
              how]
    base = {"target": "model-update", "client": client, "class": None, "n": n,
            "round": round_, "view": "plain-upload", "dp": dp_sgd, "n_true": _size(truth),
            "needed": needed}

    def run() -> Attacked:
        t0 = time.perf_counter()
        view.load_state(start)
        d, model = view.exp.data, view.model
        res = invert_model_update(model, start, entry["tensors"], recipe, n=n,
                                  image_shape=d.x_train.shape[1:], mean=d.mean, std=d.std,
                                  generator=make_generator(opts.seed, client, round_, 66),
                                  config=dataclasses.replace(
                                      opts.inversion, restarts=1, tv_weight=1e-2,
                                      l2_weight=0.0, jitter=0, bn_weight=0.0))
        view.load_state(start)
        rec, matched = score(view, res.images, truth, paired=False)
        got = sorted(res.labels.tolist())
        error = None if truth is None else _count_error(
            got, sorted(view.truth_exp.data.y_train[truth].tolist()), d.num_classes)
        record = {**base, **rec, "mode": "update-simulated-training",
                  "target_cosine": res.gradient_cosine, **_convergence(res.convergence),
                  "recovered_labels": got, "label_count_error": error,
                  "seconds": round(time.perf_counter() - t0, 3)}
        return Attacked(record, matched, res.images.detach().cpu())

    return Job(f"model-update client {client} round {round_} (n={n})", run, entry, base)


def _count_error(got: Sequence[int], true: Sequence[int], classes: int) -> int:
    """Sum over classes of |recovered count - true count| (0: labels exactly right)."""
    a = torch.bincount(torch.as_tensor(list(got), dtype=torch.long), minlength=classes)
    b = torch.bincount(torch.as_tensor(list(true), dtype=torch.long), minlength=classes)
    return int((a - b).abs().sum())


def updates_aggregated(view: RunView) -> bool:
    """The transcript records model updates, none of them a client's plain upload: they
    were summed under secure aggregation (the server saw ciphertexts and the sum)."""
    views = {e["view"] for e in view.entries if e["label"] == UPDATE_LABEL}
    return bool(views) and "plain-upload" not in views


def plan_updates(view: RunView, opts: AttackOptions,
                 clients: Sequence[int] | None = None) -> Plan:
    """Inversion of the per-client model updates the transcript records (label
    ``model-update``, view ``plain-upload``) against the round's global state (label
    ``round``). Under secure aggregation of updates only the aggregate exists: noted, not
    attacked (it mixes every participant's images)."""
    plan = Plan(attack_batch=opts.attack_batch)
    ups = [e for e in view.entries if e["label"] == UPDATE_LABEL]
    if not ups:
        plan.notes.append("this transcript records no model updates: attacking a simulated "
                          "one (one local SGD step on --update-batch images)")
        return plan
    rounds = sorted({e["round"] for e in ups if e["view"] == "plain-upload"})
    if not rounds:
        plan.notes.append("model updates were securely aggregated: no per-client update to "
                          "invert (the aggregate mixes every participant)")
        return plan
    round_ = opts.round if opts.round is not None else rounds[-1]
    if round_ not in rounds:
        raise UsageError(f"no per-client model update in round {round_}; rounds: "
                         f"{', '.join(map(str, rounds))}")
    starts = [e for e in view.entries if e["label"] == ROUND_LABEL
              and e["view"] == "model-state" and e["round"] == round_]
    if not starts:
        raise UsageError(f"the transcript has no global state (label 'round') for round {round_}")
    seen = {int(e["client"]): e for e in ups
            if e["round"] == round_ and e["view"] == "plain-upload"}
    chosen = list(clients) if clients else sorted(seen)[:1]
    missing = [c for c in chosen if c not in seen]
    if missing:
        raise UsageError(f"client(s) {missing} sent no model update in round {round_}; "
                         f"clients: {', '.join(map(str, sorted(seen)))}")
    for c in chosen:
        plan.jobs.append(_recorded_update_job(view, opts, round_, starts[0]["tensors"],
                                              seen[c]))
    return plan


def execute(plan: Plan, on_done: Callable[[Job], None] | None = None, *,
            attack_batch: int | None = None) -> list[Attacked]:
    """Run every job of a plan; results in plan order (each job loads the model state it
    needs). Feature inversions through the same model, state and settings are optimised
    together, up to ``attack_batch`` (default ``plan.attack_batch``) targets at a time
    (``invert_features_many``: every target's result is the one it gets alone); 1 runs
    every job on its own, in order."""
    size = plan.attack_batch if attack_batch is None else attack_batch
    if size < 1:
        raise UsageError(f"--attack-batch must be >= 1, got {size}")
    out: list[Attacked | None] = [None] * len(plan.jobs)
    groups: dict[Any, list[int]] = {}
    prepared: dict[int, tuple[Inversion, Callable[[Any, float], Attacked]]] = {}
    for i, job in enumerate(plan.jobs):
        if size == 1 or job.prepare is None:
            out[i] = job.run()
            if on_done is not None:
                on_done(job)
            continue
        inv, finish = prepared[i] = job.prepare()
        group = (inv.solve, id(inv.model), id(inv.state), inv.config, inv.group)
        groups.setdefault(group, []).append(i)
    for members in groups.values():
        # one inversion per shared key; similar image counts together (less padding)
        first: dict[Any, int] = {}
        for i in members:
            first.setdefault(prepared[i][0].key if prepared[i][0].key is not None else i, i)
        unique = sorted(first.values(), key=lambda i: prepared[i][0].images)
        results: dict[int, tuple[Any, float]] = {}
        for chunk in _chunks(unique, [prepared[i][0].images for i in unique], size):
            t0 = time.perf_counter()
            many = prepared[chunk[0]][0].solve([prepared[i][0] for i in chunk])
            share = (time.perf_counter() - t0) / len(chunk)  # "seconds": a share of the batch
            for i, res in zip(chunk, many, strict=True):
                results[i] = res, share
        for i in members:
            inv, finish = prepared[i]
            src = first[inv.key if inv.key is not None else i]
            out[i] = finish(*results[src])
            if on_done is not None:
                on_done(plan.jobs[i])
    return out  # type: ignore[return-value]


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


def infer_class_sets(view: RunView, opts: AttackOptions) -> tuple[list[dict[str, Any]], list[str]]:
    """Every client's class set (and counts, when uploaded) from every calibration release,
    scored against the partition; under secure aggregation only the federation's."""
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    truth = None if view.truth_exp is None else torch.as_tensor(view.truth_exp.counts,
                                                                 dtype=torch.float64)
    if truth is None:
        notes.append("unscored: the clients' class counts are on the experimenter's side of "
                     "the run folder, not in the server's view")
    for label in (STATS_LABEL, GRAD_LABEL):
        for rel in view.releases(label):
            if rel.uploads:
                sources = [(c, p, "plain-upload", None if truth is None else truth[c])
                           for c, p in sorted(rel.uploads.items())]
            elif rel.aggregate is not None:
                sources = [(None, rel.aggregate, "aggregate",
                            None if truth is None else truth.sum(0))]
                note = (f"{label}: secure aggregation hides per-client class sets; the aggregate "
                        "only tells which classes the federation holds")
                if note not in notes:
                    notes.append(note)
            else:
                continue
            for client, payload, seen, true_counts in sources:
                stds = view.noise_stds(label, list(payload))
                pred = infer_classes(payload, noise_std=stds,
                                     false_positive_rate=opts.false_positive_rate)
                known = true_counts is not None
                records.append({
                    "target": "class-set", "client": client, "class": None,
                    "n": int(true_counts.sum()) if known else None, "round": rel.round,
                    "label": label, "view": seen, "dp": any(s > 0 for s in stds.values()),
                    **(score_class_sets(pred, true_counts) if known else {"scored": False}),
                    "present": torch.nonzero(pred[0]).flatten().tolist(),
                    "true_classes": (torch.nonzero(true_counts > 0).flatten().tolist()
                                     if known else None),
                    "counts": None if pred[1] is None else [round(float(v), 2) for v in pred[1]],
                    "true_counts": [int(v) for v in true_counts] if known else None,
                })
    if not records:
        raise UsageError(f"the transcript of {view.run_dir} holds no calibration uploads "
                         f"({STATS_LABEL} or {GRAD_LABEL})")
    return records, notes
