"""One run, many canaries: the one-run bound on a whole run's calibration uploads.

Steinke, Nasr and Jagielski (NeurIPS 2023) audit a mechanism with ONE run: m canaries, each
included independently with probability 1/2 (a coin from OS entropy), the auditor guesses
the membership of the canaries it is surest about, and the count of right guesses bounds
epsilon (``privacy/empirical.one_run_epsilon``). Andrew et al. (ICLR 2024) apply the same
idea to federated learning with canary clients.

Here the run is every calibration upload of the configuration: each client's release (CCVR
once; CReFF in every round the server selects the client, ``seeding.select_clients``) of its
features plus its included canaries, through the run's payload task, bound and noise stage
(``attacks/distinguishing/channels.py``). Canary (k, c, j) is a feature ``16 x clip`` on axis j of class
c in client k, so its own coordinates are ``sum[c, j]`` and ``outer[c, j, j]`` (CCVR) or
column j of ``grad[c]`` (CReFF), which no other canary touches (``_own`` finds them from each
key's shape and the release's declared symmetric keys, not from the key's name); ``count`` and ``holders`` are
shared by the canaries of a class and left out of the score. Each canary's score is the
noise-weighted projection of the view, less the client's own payload (the auditor knows D),
onto that canary's own change; the top and the bottom ``guesses / 2`` of the scores are
guessed in and out. The claim is the channel's: each canary sits in one client and is
charged like any of its examples.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from privfedcal.attacks.distinguishing.channels import (
    CANARY_SCALE,
    Faults,
    FeatureMap,
    canary_scale,
    claimed,
    client_features,
    noiser,
    run_parts,
)
from privfedcal.attacks.distinguishing.games import BUDGET_STOP, budget_spent
from privfedcal.attacks.release_attacks import attacks_of
from privfedcal.errors import UsageError
from privfedcal.experiment import config_of
from privfedcal.privacy.empirical import one_run_epsilon
from privfedcal.settings.messages import SettingError


def _own(key: str, c: Tensor, j: Tensor, payload: dict[str, Tensor],
         symmetric: frozenset[str]) -> Tensor:
    """(canaries, coordinates) of ``payload[key]`` that canaries (c, j) alone move, from the
    key's shape and its declaration: a feature sum (C, d) moves entry (c, j); a matrix the
    release declares symmetric (C, d, d) its diagonal entry (c, j, j); any other block
    (C, C', d') column j of class c's block (CReFF's gradient: its row's feature j)."""
    v = payload[key]
    if v.dim() == 2:
        return v[c, j].unsqueeze(1)
    if key in symmetric:
        return v[c, j, j].unsqueeze(1)
    return v[c, :, j]


def one_run(cfg, *, axes: int | None = None, guesses: float = 0.05, confidence: float = 0.95,
            faults: Faults = Faults(), budget_s: float | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """The one-run row of dp_audit.csv for the calibration channel of ``cfg``: canaries on
    the first ``axes`` feature axes (all by default) of every class of every client, and
    ``guesses`` of them guessed (half in, half out; 5% measured best of 5% and 20%,
    docs/results/privacy.md).

    ``budget_s``: the clients are released one after another and the audit stops after the
    client in which the budget ran out (at least one); the canaries of the clients released
    are scored, the claim is that of their releases, and the row is marked ``stopped`` =
    ``budget``. ``progress(clients done, clients)`` after every client."""
    if not 0 < guesses <= 1:
        raise UsageError(f"the one-run audit's guesses must be in (0, 1], got {guesses}")
    exp, calibrator, noise, bound, plan = run_parts(cfg, faults)
    t0 = time.perf_counter()
    cfg = config_of(exp)  # resolved
    spec, attack = _audited_release(calibrator)
    label, task, keys = spec.label, attack.task(cfg, exp, calibrator), attack.canary_keys
    rounds = _client_rounds(exp.privacy, spec, calibrator)
    classes, dim = exp.data.num_classes, exp.model.feature_dim
    axes = dim if axes is None else min(axes, dim)
    c, j, canaries, member = _canaries(classes, dim, axes,
                                       CANARY_SCALE * canary_scale(bound, attack.clip),
                                       cfg.data.clients)
    var = _variances(plan, keys, label)
    release = noiser(noise, label, faults)
    model = FeatureMap(dim)
    scores: list[Tensor] = []
    members: list[Tensor] = []
    done: list[int] = []
    for k in range(cfg.data.clients):
        if done and budget_spent(t0, budget_s):
            break
        if progress is not None:
            progress(k, cfg.data.clients)
        if not rounds[k]:
            continue  # never selected: its canaries reach no release
        done.append(k)
        inc = member[k]
        clean, full, view_clean = _payloads(task, model, *client_features(exp, k), canaries,
                                            c, inc, bound)
        own = functools.partial(_own, c=c, j=j, symmetric=spec.symmetric)
        scores.append(_client_score(own, len(c), keys, var, clean, full, view_clean,
                                    release, len(rounds[k])))
        members.append(inc)
    score, truth = torch.cat(scores), torch.cat(members)
    m = len(score)
    half, right = guess_membership(score, truth, guesses)
    steps = max(len(rounds[k]) for k in done)
    eps_claim, delta = claimed(plan, label, steps)
    eps = one_run_epsilon(m, 2 * half, right, delta, confidence)
    stopped = [k for k in range(cfg.data.clients) if rounds[k]] != done
    if progress is not None:
        progress(cfg.data.clients, cfg.data.clients)
    return {"channel": f"{label} (one run)", "claimed_eps": eps_claim, "delta": delta,
            "eps_lower": eps, "confidence": confidence, "trials": 1,
            "canary": _canaries_text(m, len(done), cfg.data.clients, classes, axes, stopped,
                                     half, right),
            "stopped": BUDGET_STOP if stopped else "",
            "score": "projection", "false_pos": 2 * half - right, "false_neg": 0,
            "test_trials": 2 * half, "seconds": time.perf_counter() - t0}


def _canaries_text(m: int, done: int, clients: int, classes: int, axes: int, stopped: bool,
                   half: int, right: int) -> str:
    """The row's ``canary`` column: the canaries, the clients released, the guesses."""
    return (f"{m} canaries ({done} client{'s' * (done != 1)} x {classes} classes x {axes} "
            f"axes, feature {CANARY_SCALE:g} x clip)"
            + (f", {done} of {clients} clients (time budget)" if stopped else "")
            + f", {2 * half} guesses, {right} right")


def _audited_release(calibrator: Any) -> tuple[Any, Any]:
    """(release spec, attack) of the calibrator's first release whose attack declares the
    keys a canary owns."""
    audited = [(r, a) for r, a in attacks_of(calibrator) if a.canary_keys and a.task]
    if not audited:
        raise SettingError("the one-run audit needs a calibration upload ({method} ccvr/creff)")
    return audited[0]


def _client_rounds(privacy: Any, spec: Any, calibrator: Any) -> list[list[int]]:
    """The rounds in which each client makes the release ``spec`` (``privacy``: the run's
    ``PrivacyOptions``): for a release of the selected clients, the rounds of the
    calibrator's release schedule (``release_rounds``, as the planner counts them) in which
    the server selects it; else one (round 1)."""
    from privfedcal.privacy.cohorts import select_clients

    if spec.participants == "selected":
        schedule = calibrator.release_rounds(privacy, spec)
        return [[r for r in schedule if k in select_clients(privacy, r)]
                for k in range(privacy.clients)]
    return [[1]] * privacy.clients


def _canaries(classes: int, dim: int, axes: int, unit: float, clients: int
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(c, j, features, member): canary i is a feature ``unit`` on axis j[i], of class
    c[i]; ``member[k, i]`` says whether client k includes it (a fair coin from OS entropy)."""
    from privfedcal.privacy.noise import noise_generator

    c = torch.arange(classes).repeat_interleave(axes)   # canary i: class c[i], axis j[i]
    j = torch.arange(axes).repeat(classes)
    canaries = torch.zeros(len(c), dim, dtype=torch.float64)
    canaries[torch.arange(len(c)), j] = unit
    member = torch.randint(0, 2, (clients, len(c)), generator=noise_generator()).bool()
    return c, j, canaries, member


def _variances(plan: Any, keys: Sequence[str], label: str) -> dict[str, float]:
    """Each canary key's noise variance in the release (1 without a DP plan)."""
    if plan is None:
        return dict.fromkeys(keys, 1.0)
    return {k: s * s for k, s in plan.dp.stds(keys, label).items()}


def _payloads(task: Any, model: Any, z: Tensor, y: Tensor, canaries: Tensor, c: Tensor,
              inc: Tensor, bound: Any) -> tuple[dict[str, Tensor], ...]:
    """A client's payloads without canaries, with all of them (what each canary would
    change) and with its included ones (what it releases)."""
    clean = task.compute(model, z, y, bound)
    full = task.compute(model, torch.cat([z, canaries]), torch.cat([y, c]), bound)
    view_clean = task.compute(model, torch.cat([z, canaries[inc]]),
                              torch.cat([y, c[inc]]), bound)
    return clean, full, view_clean


def guess_membership(score: Tensor, truth: Tensor, guesses: float) -> tuple[int, int]:
    """(half, right): of the m canaries, the ``half`` with the top scores are guessed in
    and the ``half`` with the bottom ones out, ``half = guesses * m / 2`` (at least 1);
    ``right`` of the ``2 * half`` guesses match ``truth`` (bool, in or out)."""
    half = max(1, int(round(guesses * len(score) / 2)))
    order = torch.argsort(score)
    return half, int(truth[order[-half:]].sum()) + int((~truth[order[:half]]).sum())


def _client_score(own: Callable[..., Tensor], n: int, keys: Sequence[str],
                  var: dict[str, float],
                  clean: dict[str, Tensor], full: dict[str, Tensor],
                  view_clean: dict[str, Tensor], release: Callable[..., dict[str, Tensor]],
                  releases: int) -> Tensor:
    """Each of a client's ``n`` canaries' score: over its ``releases`` (a fresh noisy release
    each round it is selected) and the canary keys, the noise-weighted projection of the
    view less the client's own payload onto the canary's own change."""
    score = torch.zeros(n, dtype=torch.float64)
    for _ in range(releases):
        view = release({kk: v.to(torch.float64).unsqueeze(0) for kk, v in view_clean.items()})
        view = {kk: v[0] for kk, v in view.items()}
        for key in keys:
            change = own(key, payload=full) - own(key, payload=clean)
            seen = own(key, payload=view) - own(key, payload=clean)
            score += (seen * change).sum(1) / max(var[key], 1e-30)
    return score


__all__ = ["one_run"]
