"""The attack on CReFF's class gradients (the release ``CREFF_RELEASE`` of
calibration/creff.py): ``attack invert --gradients``, and the release's channel in
``audit dp``.

Per attacked upload and class: the analytic recovery of the class gradient's features
(``gradient_inversion``: the weighted-mean feature, or with the head the client used and a
small n the n features exactly, rank-n), then feature inversion to images; and per client
and class, the class gradients of up to ``--rounds-combined`` rounds inverted together
(``rounds.invert_class_gradients``). The model-update attack (``updates_attack.py``) joins
it in one ``attack invert --gradients --updates``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.reconstruction.feature_inversion import (
    FeatureTarget,
    InversionResult,
    shape_of,
)
from privfedcal.attacks.reconstruction.gradient_inversion import (
    gradient_rank,
    recover_from_class_gradient,
    recover_rank_n,
    split_class_gradient,
)
from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.attacks.reconstruction.rounds import invert_class_gradients_many
from privfedcal.attacks.reconstruction.runner import (
    Inversion,
    InversionOptions,
    Job,
    Plan,
    convergence_record,
    run_alone,
    size_of,
    solve_features,
)
from privfedcal.attacks.reconstruction.scoring import Attacked, score
from privfedcal.attacks.reconstruction.uploads import classes_to_attack, sources
from privfedcal.attacks.release_attacks import ReleaseAttack, release_for
from privfedcal.attacks.view import Release, RunView
from privfedcal.calibration.creff import CREFF_RELEASE
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError

NAME = "gradients"


@dataclasses.dataclass(frozen=True)
class GradientsOptions(InversionOptions):
    """``attack invert --gradients``: the inversions' options, rank-n recovery and the
    rounds combined."""

    rounds_combined: int = attack_option(3, "CReFF releases of one client and class inverted "
                                         "together (1: one release at a time).")
    rank_max: int = attack_option(3, "Largest n for rank-n feature recovery from a class "
                                  "gradient.", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds_combined < 1:
            raise SettingError("{rounds_combined} must be >= 1 (1: one release at a time)")


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
    first = min((r.round for r in view.releases(rel.label)), default=None)
    initial = view.cfg.calibration_params.get(
        "initial_head", getattr(CReFFParams, "initial_head", "global"))
    if rel.state is None or rel.round != first or initial != "global":
        return None
    head = read_head(rel.state)
    return effective_weight(head.weight.double(), head.normalized), (
        None if head.bias is None else head.bias.double())


def differentiated_inputs(view: RunView, rel: Release) -> Callable[[Tensor], Tensor] | None:
    """The inputs CReFF's clients differentiated in release ``rel``, as a function of
    training indices; None without augmentation or without the experimenter's side.

    Under DSA (``--creff-dsa``, on by default) a client's class gradient is that of the
    features of its AUGMENTED images (``GradTask.augment``: the transform set its class and
    content pick, drawn from the round's task seed), not of the images it holds. The
    one-sample recovery ``dW_j / db_j`` is exact for that feature, which can differ from the
    original image's (cosine down to 0.994 on the quick digits run, docs/privacy/attacks.md);
    the scoring compares features with these inputs', recomputed here from public values
    (the run's seed and options) and the true images."""
    from privfedcal.calibration.creff import GradTask, task_seed
    from privfedcal.calibration.draws import content_keys
    from privfedcal.data.dsa import parse_strategy
    from privfedcal.experiment import build_calibrator
    from privfedcal.seeding import derive_seed

    if view.truth_exp is None:
        return None
    params = build_calibrator(view.cfg, view.exp).params
    if not parse_strategy(params.dsa):
        return None
    # the seed of the round's generator, as the simulator's RoundContext draws it
    # (federation/simulator.py: make_generator(seed, round, 0, 4))
    seed = task_seed(derive_seed(view.cfg.training.seed, rel.round, 0, 4))
    d = view.truth_exp.data
    task = GradTask(torch.zeros(d.num_classes, 1), None, d.num_classes, seed=seed,
                    dsa=params.dsa, dsa_groups=params.client_draws or 10)

    def inputs(idx: Tensor) -> Tensor:
        idx = idx.to(d.x_train.device)
        x = d.x_train[idx]
        return task.augment(x, d.y_train[idx], content_keys(x, seed))

    return inputs


def recovered_cosine(view: RunView, z: Tensor, truth_idx: Tensor,
                     inputs: Callable[[Tensor], Tensor] | None) -> float:
    """The worst cosine between recovered features ``z`` (k, d) and the features the
    clients differentiated (``inputs`` of the true samples, or the samples themselves),
    matched one to one (Hungarian on the cosine); for k = n = 1 the exactness of the
    analytic recovery."""
    from scipy.optimize import linear_sum_assignment

    d = view.truth_exp.data
    x = inputs(truth_idx) if inputs is not None else d.x_train[truth_idx.to(d.x_train.device)]
    with eval_mode(view.model), torch.no_grad():
        true = view.model.features(x).double()
    cos = torch.nn.functional.cosine_similarity(z.double().to(true.device)[:, None],
                                                true[None], dim=-1)
    rows, cols = linear_sum_assignment(-cos.cpu().numpy())
    return float(cos[rows, cols].min())


def _gradient_job(view: RunView, opts: GradientsOptions, state: dict[str, Tensor], block: Tensor,
                  truth_idx: Tensor | None, base: dict[str, Any], seed: int,
                  head: tuple[Tensor, Tensor | None] | None = None,
                  n_known: int | None = None,
                  inputs: Callable[[Tensor], Tensor] | None = None) -> Job:
    """Class-gradient attack: with the head known and n <= ``opts.rank_max`` (n from the
    uploaded count, else the gradient's rank when below C - 1) the n features are recovered
    exactly (``recover_rank_n``) and inverted as a batch; otherwise the least-squares
    weighted-mean feature is inverted to one image. ``inputs``: what the client
    differentiated (``differentiated_inputs``), the truth its features are scored against;
    where the recovery claims exactness (one feature per true sample) the record's
    ``recovered_cosine`` scores the recovered features before any image is inverted."""

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
            recovered, how = rn.features.float(), "rank-n+"
            extra.update(rank_n_residual=rn.residual,
                         needed=["the head the client used", "n (count or gradient rank)"])
        else:  # the least-squares weighted-mean feature, one image
            recovered, how = z.reshape(-1, z.shape[-1]), "analytic+"
            extra["needed"] = ["the class gradient only"]
        target = FeatureTarget.raw(recovered)
        if inputs is not None:  # feature_cosine and recovered_cosine: against these
            extra["features_of"] = "the augmented images (DSA) the clients differentiated"
        if truth_idx is not None and view.truth_exp is not None and \
                recovered.shape[0] == truth_idx.numel():
            extra["recovered_cosine"] = recovered_cosine(view, recovered, truth_idx, inputs)
        inv = Inversion(view, view.model, state, target, make_generator(opts.seed, seed, 0, 63),
                        opts.inversion, solve_features, shape_of(target)[1],
                        group=shape_of(target)[0])

        def finish(res: InversionResult, seconds: float) -> Attacked:
            view.load_state(state)
            rec, matched = score(view, res.images, truth_idx, paired=False, inputs=inputs)
            label = int(info.label)
            record = {**base, **rec, "mode": how + res.mode, "target_cosine": res.cosine,
                      "recovered_label": label, "label_correct": label == base["class"],
                      "fit_residual": float(info.residual),
                      "single_sample": bool(info.single_sample),
                      **extra, **convergence_record(res.convergence), "seconds": round(seconds, 3)}
            return Attacked(record, matched, res.images.detach().cpu())

        return inv, finish

    client = "all" if base["client"] is None else base["client"]
    return Job(f"class-gradient client {client} class {base['class']} (n={base['n']})",
               run_alone(view, prepare, {}), block, base, prepare)


def plan_gradients(view: RunView, opts: GradientsOptions, clients: Sequence[int] | None = None,
                   classes: Sequence[int] | None = None) -> Plan:
    """Analytic + feature inversion of CReFF class gradients, and across rounds with
    ``opts.rounds_combined`` > 1."""
    plan = Plan(attack_batch=opts.attack_batch)
    label = release_for(NAME).label
    rel = view.release(label, opts.round)
    head = creff_head(view, rel)
    if head is None:
        plan.notes.append(f"class gradients of round {rel.round}: the head CReFF sent is "
                          "not in the transcript (written before heads were recorded), "
                          "so no rank-n recovery (weighted-mean features); only the first "
                          "release of a run with initial_head=global uses the sent "
                          "model's head")
    inputs = differentiated_inputs(view, rel)
    for client, payload, seen in sources(view, rel, clients, plan, opts.default_clients):
        stds = view.noise_stds(label, list(payload))
        noisy = any(s > 0 for s in stds.values())
        for c, inferred in classes_to_attack(view, client, payload, stds, classes, opts, plan,
                                                label=label):
            truth = view.truth(client, c)
            n_obs = float(payload["count"][c]) if "count" in payload else None
            n_shown = size_of(truth) if truth is not None else (
                max(1, int(round(n_obs))) if n_obs is not None else 0)
            base = {"target": "class-gradient", "client": client, "class": c,
                    "n": n_shown, "n_observed": n_obs, "round": rel.round,
                    "view": seen, "dp": noisy, "n_true": size_of(truth),
                    "class_inferred": inferred}
            tag = c + 1000 * client + 10**6 * rel.round
            n_known = (max(1, int(round(n_obs))) if n_obs is not None and not noisy
                       else None)
            block = payload["grad"][c]  # a sum under sample weighting: make it a mean
            block = block / max(n_obs, 1.0) if n_obs is not None else block
            plan.jobs.append(_gradient_job(view, opts, rel.sent_state, block, truth,
                                           base, tag, head=None if noisy else head,
                                           n_known=n_known, inputs=inputs))
    if opts.rounds_combined > 1:
        _plan_rounds(view, opts, rel, clients, classes, plan)
    return plan


def _plan_rounds(view: RunView, opts: GradientsOptions, last: Release,
                 clients: Sequence[int] | None, classes: Sequence[int] | None,
                 plan: Plan) -> None:
    """One job per attacked (client, class) that combines the client's class gradients of
    up to ``opts.rounds_combined`` releases ending at ``last`` (each with the model state
    and head the server sent; ``invert_class_gradients``). Only plain, noise-free uploads
    with a recorded head; n from the uploaded count, else from the gradient's rank when
    below C - 1, else not attacked (noted)."""
    rels = [r for r in view.releases(last.label) if r.round <= last.round and r.uploads
            and r.state is not None and "head.weight" in r.task][-opts.rounds_combined:]
    if len(rels) < 2 or any(s > 0 for s in view.noise_stds(last.label, ["grad"]).values()):
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
                    "n": size_of(truth) if truth is not None else n_est, "n_used": n_est,
                    "round": last.round, "rounds": [r.round for r in having],
                    "view": "plain-upload", "dp": False, "n_true": size_of(truth),
                    "class_inferred": True}
            plan.jobs.append(_rounds_job(view, opts, having, blocks, truth, base,
                                         c + 1000 * client + 10**6 * last.round + 7))


def _rounds_job(view: RunView, opts: GradientsOptions, rels: list[Release], blocks: list[Tensor],
                truth_idx: Tensor | None, base: dict[str, Any], seed: int) -> Job:
    def prepare() -> tuple[Inversion, Callable[[Any, float], Attacked]]:
        heads = [creff_head(view, r) for r in rels]
        target = ([r.state for r in rels], heads, blocks, base["class"], base["n_used"])
        inv = Inversion(view, view.model, rels[-1].sent_state, target,
                        make_generator(opts.seed, seed, 0, 68),
                        dataclasses.replace(opts.inversion, restarts=1, tv_weight=1e-2,
                                            l2_weight=0.0, jitter=0, bn_weight=0.0),
                        _solve_rounds, base["n_used"], group=tuple(r.round for r in rels))

        def finish(res: Any, seconds: float) -> Attacked:
            view.load_state(rels[-1].sent_state)
            rec, matched = score(view, res.images, truth_idx, paired=False)
            record = {**base, **rec, "mode": "class-gradients-across-rounds",
                      "target_cosine": res.gradient_cosine, **convergence_record(res.convergence),
                      "needed": ["the model state and head sent in every combined round",
                                 "n (count or gradient rank)",
                                 "the same samples in every round (n within CReFF's per-class "
                                 "draw cap)"],
                      "seconds": round(seconds, 3)}
            return Attacked(record, matched, res.images.detach().cpu())

        return inv, finish

    return Job(f"class gradients client {base['client']} class {base['class']} rounds "
               f"{','.join(map(str, base['rounds']))} (n={base['n']})", run_alone(view, prepare, {}),
               blocks, base, prepare)


def task(cfg, exp, calibrator):
    """CReFF's client task with the run's options and the initial model's head."""
    from privfedcal.calibration.creff import GradTask

    p = calibrator.params
    head = exp.model.classifier
    cap = None if p.client_draws is None else p.client_draws * p.draw_size
    return GradTask(head.weight.detach().double().cpu(),
                    None if head.bias is None else head.bias.detach().double().cpu(),
                    exp.data.num_classes, p.weighting, p.feature_batch_size, cap, cfg.training.seed)


def keep(key: str, c: int) -> tuple:
    """The entries a canary feature on axis 0 of class c moves: its head gradient
    (p - e_c) [z, 1] moves columns 0 and d (the bias) of its class's row only; its count
    and holder flag."""
    return (slice(c, c + 1), slice(None), [0, -1]) if key == "grad" else (slice(c, c + 1),)


class GradientsAttack(ReleaseAttack):
    """The inversion of CReFF's class gradients."""

    name = NAME
    labels = (CREFF_RELEASE,)
    clip = "class-gradient"
    canary_keys = ("grad",)
    options = GradientsOptions
    summary = "Invert CReFF class gradients."
    targets = ("class-gradient", "class-gradient-rounds")
    # gradient matching and head retraining shortened for the sweep
    audit_params = {"match_steps": 50, "retrain_steps": 100}
    plan = staticmethod(plan_gradients)
    task = staticmethod(task)
    keep = staticmethod(keep)


#: the attack, as the registry finds it (``release_attacks.RELEASE_ATTACKS``)
ATTACK = GradientsAttack()

__all__ = ["ATTACK", "NAME", "GradientsAttack", "GradientsOptions", "creff_head", "differentiated_inputs", "keep", "plan_gradients",
           "recovered_cosine", "task"]
