"""The attack on model updates (label ``model-update``, ``privacy/releases.py``): ``attack
invert --updates`` (alone or with ``--gradients``).

A recorded per-client update is inverted through simulated multi-step local training with
the recorded recipe (``model_updates.invert_model_update``); a transcript without one gets
the hypothetical baseline of a simulated one-step update on a few of a client's images
(``model_updates.invert_update``). Securely aggregated updates are not attacked (the sum
mixes every participant). Model updates are the uplink's own release, not a calibrator's:
the attack ``updates`` registers with no release of its own and joins ``gradients`` (the
simulated update is taken at the model state of the class-gradient release when the run
has one).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.reconstruction.model_updates import (
    LocalRecipe,
    invert_model_update,
    invert_update,
)
from privfedcal.attacks.reconstruction.runner import (
    InversionOptions,
    Job,
    Plan,
    convergence_record,
    size_of,
)
from privfedcal.attacks.reconstruction.scoring import Attacked, score
from privfedcal.attacks.release_attacks import ReleaseAttack, release_for
from privfedcal.attacks.view import Release, RunView
from privfedcal.errors import UsageError
from privfedcal.privacy.releases import ROUND_RECORD, UPDATE_RELEASE
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError

NAME = "updates"
#: the attacks this one runs beside in one ``attack invert`` (their release's model state
#: is the one a simulated update starts from)
JOINS = ("gradients",)


@dataclasses.dataclass(frozen=True)
class UpdatesOptions(InversionOptions):
    """``attack invert --updates``: the inversions' options and the simulated update's
    batch."""

    update_batch: int = attack_option(4, "Local batch of the simulated model update.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.update_batch < 1:
            raise SettingError(f"{{update_batch}} must be >= 1, got {self.update_batch}")


def _update_job(view: RunView, opts: UpdatesOptions, rel: Release, client: int) -> Job:
    """The server's view of one local SGD step (lr of the run, plain cross-entropy, train
    mode) on ``update_batch`` of the client's images, then Geiping et al.'s inversion."""

    def run() -> Attacked:
        t0 = time.perf_counter()
        d, model = view.truth_exp.data, view.model
        idx = view.truth_exp.parts[client]
        g = make_generator(opts.seed, client, rel.round, 64)
        pick = idx[torch.randperm(idx.numel(), generator=g)[:opts.update_batch].to(idx.device)]
        view.load_state(rel.sent_state)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        model.train()  # the client's own step: batch statistics, as in local training
        try:
            loss = F.cross_entropy(model(d.x_train[pick]), d.y_train[pick])
            grads = torch.autograd.grad(loss, [p for _, p in named])
        finally:
            view.load_state(rel.sent_state)  # undo running-statistics updates; back to eval mode
        lr = view.cfg.training.lr
        update = {n: -lr * gr.detach() for (n, _), gr in zip(named, grads, strict=True)}
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


def _recorded_update_job(view: RunView, opts: UpdatesOptions, round_: int,
                         start: dict[str, Tensor], entry: dict[str, Any]) -> Job:
    """Invert one client's recorded model update (labels first, multi-step local training
    simulated with the recorded recipe; ``model_updates.invert_model_update``)."""
    client = int(entry["client"])
    cfg = view.cfg
    t = cfg.training
    recipe = LocalRecipe(epochs=int(entry.get("local_epochs", t.local_epochs)),
                         batch_size=int(entry.get("batch_size", t.batch_size)),
                         lr=float(entry.get("lr", t.lr)), momentum=float(t.momentum),
                         weight_decay=float(t.weight_decay))
    weight = entry.get("weight")
    truth = view.client_indices(client)
    # Under --dp-train the server averages with uniform public weights (1 per client): the
    # weight is no sample count, and inverting one image would under-report the leak.
    dp_sgd = cfg.privacy.dp_train
    if weight is not None and float(weight) >= 1 and not dp_sgd:
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
            "round": round_, "view": "plain-upload", "dp": dp_sgd, "n_true": size_of(truth),
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
                  "target_cosine": res.gradient_cosine, **convergence_record(res.convergence),
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
    views = {e["view"] for e in view.entries if e["label"] == UPDATE_RELEASE}
    return bool(views) and "plain-upload" not in views


def plan_updates(view: RunView, opts: UpdatesOptions,
                 clients: Sequence[int] | None = None) -> Plan:
    """Inversion of the per-client model updates the transcript records (label
    ``model-update``, view ``plain-upload``) against the round's global state (label
    ``round``). Under secure aggregation of updates only the aggregate exists: noted, not
    attacked (it mixes every participant's images)."""
    plan = Plan(attack_batch=opts.attack_batch)
    ups = [e for e in view.entries if e["label"] == UPDATE_RELEASE]
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
    starts = [e for e in view.entries if e["label"] == ROUND_RECORD
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


def add_updates(view: RunView, opts: UpdatesOptions, clients: Sequence[int] | None, plan: Plan,
                *, near: str | None) -> None:
    """Add to ``plan`` the inversion of the per-client model updates the transcript records,
    else of a simulated local model update of each attacked client (model updates are never
    encrypted as calibration payloads are, so this works under secure aggregation of the
    payloads too), taken at the model state of release ``near`` (None: the latest release
    the transcript records a state for)."""
    if updates_aggregated(view):
        # no simulated update either: it would stand in for an upload the server never saw
        plan.notes.append(f"the model updates of {view.run_dir} were securely aggregated "
                          "(--secagg-updates): there is no per-client update to attack, only "
                          "the aggregate of every participant's")
        return
    recorded = plan_updates(view, opts, clients)
    if recorded.jobs:
        plan.jobs += recorded.jobs
        plan.notes += recorded.notes
        return
    plan.notes += recorded.notes
    if near is None:
        plan.notes.append("no class gradients in this transcript (not a CReFF run): "
                          "attacking model updates only")
    labels = sorted({e["label"] for e in view.entries if e["view"] == "model-state"})
    rel = view.release(near if near is not None else labels[-1], opts.round)
    chosen = list(clients) if clients else [0]  # one client's update by default
    for c in chosen:
        if not 0 <= c < view.cfg.data.clients:
            raise UsageError(f"client {c} out of range 0..{view.cfg.data.clients - 1}")
        if not view.scored:
            plan.notes.append("no simulated model update: it needs a client's images (the "
                              "experimenter's side of the run folder)")
            continue
        plan.jobs.append(_update_job(view, opts, rel, c))


def plan_model_updates(view: RunView, opts: UpdatesOptions,
                       clients: Sequence[int] | None = None,
                       classes: Sequence[int] | None = None) -> Plan:
    """``attack invert --updates``: the recorded per-client updates, else a simulated one
    at the model state of the release of an attack it joins (``JOINS``) when the run made
    one; ``classes`` does not apply (an update mixes every class a client holds)."""
    plan = Plan(attack_batch=opts.attack_batch)
    labels = {e["label"] for e in view.entries}
    near = next((label for label in (release_for(n).label for n in JOINS) if label in labels),
                None)
    add_updates(view, opts, clients, plan, near=near)
    return plan


class UpdatesAttack(ReleaseAttack):
    """The inversion of the recorded per-client model updates."""

    name = NAME
    labels = (UPDATE_RELEASE,)
    options = UpdatesOptions
    joins = JOINS
    summary = ("Invert the recorded per-client model updates (a simulated one if the "
               "transcript has none); alone or with --gradients.")
    targets = ("model-update",)
    plan = staticmethod(plan_model_updates)


#: the attack, as the registry finds it (``release_attacks.RELEASE_ATTACKS``)
ATTACK = UpdatesAttack()

__all__ = ["ATTACK", "JOINS", "NAME", "UpdatesAttack", "UpdatesOptions", "add_updates", "plan_model_updates",
           "plan_updates", "updates_aggregated"]
