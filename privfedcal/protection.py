"""The protection plan of a run: from its options to the uplink's stages.

Plans the DP noise of every release, sets up CKKS, checks the combination of flags, and
builds the ``Uplink`` whose stages (privacy/stages.py, privacy/secagg_stage.py) run it.
This layer knows the methods and calibrators (which releases a calibrator declares, whether
a method's loss suits DP-SGD); ``privacy/`` holds only the mechanisms.

What each flag protects (docs/privacy.md has the whole story):
- ``--dp-eps``: sample-level (epsilon, delta)-DP of the calibration uploads (features clipped
  to ``--dp-clip``, per-sample class gradients to ``--dp-grad-clip``), composed over every
  release by one accountant; with ``--dp-train`` also of the model updates (DP-SGD).
- ``--dp-updates``: user-level DP-FedAvg of the model updates (privacy/user_dp.py), charged
  to the same per-client accountants as the uploads.
- ``--secagg``: the server sees ciphertexts and the decrypted sum only (CKKS, TenSEAL).
- ``--hide-counts``: uploads have one shape whatever classes a client holds; counts and
  CReFF's holder indicators travel inside the ciphertexts (or DP-noised without secagg).
"""

from __future__ import annotations

import math

from privfedcal.algorithms.algorithm import ALGORITHMS
from privfedcal.cohorts import (
    check_schedule,
    cohort_plan,
    observers_own,
    per_round,
    secure_minimum,
    select_clients,
)
from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import PrivacyAccountant, ReleasePlan, plan_noise
from privfedcal.privacy.dp import L2Clip, default_delta
from privfedcal.privacy.dp_stage import ASSUMPTIONS, DPStage
from privfedcal.privacy.noise import warn_if_seeded
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.stages import Stage, StagePlan, planned_stages
from privfedcal.privacy.uplink import Uplink

#: feature bound when secure aggregation runs without DP (CKKS needs a magnitude bound;
#: features of the shipped models are far inside it, so it rarely clips anything)
SECAGG_DEFAULT_CLIP = 1000.0
#: default feature bound R under DP (data-independent; the digits MLP's feature norms have a
#: median near 12, so 10 clips about half of them: tune --dp-clip for other models)
DP_DEFAULT_CLIP = 10.0
DP_DEFAULT_GRAD_CLIP = 1.0


def dpsgd_methods() -> tuple[str, ...]:
    """Methods whose local loss is a mean of per-sample terms (what DP-SGD can make
    private): each declares it (``Algorithm.dp_sgd``)."""
    return tuple(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).dp_sgd)


def participation_counts(cfg, rounds=None) -> dict[int, int]:
    """Rounds each client is selected in (among ``rounds``, default every round): the
    server's choice, a function of the public config (``cohorts.select_clients``), known
    before training."""
    counts = dict.fromkeys(range(cfg.clients), 0)
    for r in (range(1, cfg.rounds + 1) if rounds is None else rounds):
        for c in select_clients(cfg, r):
            counts[c] += 1
    return counts


def planned_participants(cfg, calibrator) -> dict[str, int]:
    """Clients asked for each release ``calibrator`` declares (from the config, never from
    the server's messages): every client, or each round's selection."""
    m = min(max(1, int(round(cfg.participation * cfg.clients))), cfg.clients)
    return {r.label: cfg.clients if r.participants == "all" else m
            for r in calibrator.releases}


def release_plans(cfg, calibrator) -> list[ReleasePlan]:
    """The releases this configuration will make, from its calibrator's declarations, for the
    accountant's plan: per client, q = 1 (no amplification from the server's choice of
    clients), over the most rounds any client takes part in for per-round releases (among
    the rounds the calibrator makes them in, ``release_rounds``: public config only).

    ``calibrator`` is the run's calibrator (class or object: ``name``, ``releases``,
    ``protectable``), looked up by ``experiment.calibrator_class``."""
    if not calibrator.protectable:
        raise UsageError(f"the {calibrator.name} calibrator re-trains on raw features of every "
                         "client: it is an upper bound, not a protocol, and cannot be combined "
                         "with DP")
    plans = []
    for r in calibrator.releases:
        steps = 1 if r.participants == "all" else max(participation_counts(
            cfg, calibrator.release_rounds(cfg, r)).values(), default=0)
        if steps < 1:
            continue  # a schedule without any round releases nothing: nothing to charge
        plans.append(ReleasePlan(r.label, 1.0, steps))
    return plans


def check_settings(cfg, exp) -> None:
    """Refuse, before any work, settings whose guarantee would not hold or would crash later."""
    n_total = exp.num_examples  # public: federation/setup.py held_examples
    f32 = 3.0e38  # features and payload sums are float32 on the client
    for flag, value in (("--dp-clip", cfg.dp_clip), ("--dp-grad-clip", cfg.dp_grad_clip)):
        if value is None:
            continue
        if not math.isfinite(value) or value * value * max(n_total, 1) * 1e3 > f32:
            raise UsageError(f"{flag} {value:g} is too large: its square times the {n_total} "
                             "training examples overflows float32 sums (the sensitivity of "
                             "sum z z^T is R^2)")
    if cfg.dp_enabled and cfg.dp_delta is not None and cfg.dp_delta >= 1.0 / max(n_total, 1):
        raise UsageError(f"--dp-delta {cfg.dp_delta:g} must be < 1/N = {1.0 / n_total:.3g} "
                         f"(N = {n_total} training examples): a mechanism that publishes one "
                         "random example outright is (0, 1/N)-DP")


def plan_with_dpsgd(cfg, exp, uploads: list[ReleasePlan], delta: float
                    ) -> tuple[list[ReleasePlan], list[float]]:
    """Plans and noise multipliers with DP-SGD: every client runs the same public schedule
    (``dpsgd_local.schedule``), so one plan covers them all."""
    from privfedcal.privacy.dpsgd_local import client_rates

    share = cfg.dp_train_share if uploads else None  # alone, DP-SGD gets the whole budget
    ((q, steps),) = client_rates(cfg, exp)
    plans = [*uploads, ReleasePlan(DPSGD_RELEASE, q, steps * cfg.rounds, share=share)]
    return plans, plan_noise(cfg.dp_eps, delta, plans, cfg.accountant)


def secure_schedule(cfg, calibrator) -> list[list[int]]:
    """The participants of every securely summed release the plan makes, in order: each
    round's selection for per-round releases and for the model updates under
    --secagg-updates, every client for a release made once."""
    releases = list(getattr(calibrator, "releases", ())) if cfg.secagg else []
    rows: list[list[int]] = []
    for r in range(1, cfg.rounds + 1):
        chosen = select_clients(cfg, r)
        if cfg.secagg_updates:
            rows.append(chosen)
        rows += [chosen for spec in releases if spec.participants != "all"
                 and r in calibrator.release_rounds(cfg, spec)]
    rows += [list(range(cfg.clients)) for spec in releases if spec.participants == "all"]
    return rows


def check_secure_aggregation(cfg, calibrator) -> None:
    """Refuse secure aggregation that protects nothing, or whose plan can sum fewer uploads
    than ``--secagg-min-clients`` (an aggregate of one is that client's upload), in one
    release or in any combination of the run's releases (``cohorts.isolated_group`` on the
    planned schedule: rounds select whole cohorts, so this holds by construction and the
    check guards the construction)."""
    releases = list(getattr(calibrator, "releases", ()))
    if cfg.secagg and not releases:
        raise UsageError(f"--secagg protects calibration uploads, and {cfg.method} with "
                         f"--calibrate {cfg.calibrate} uploads none: use --secagg-updates to "
                         "hide the model updates")
    if not (cfg.secagg or cfg.secagg_updates):
        return
    need = secure_minimum(cfg)
    minimum = f"--secagg-min-clients {cfg.secagg_min_clients}" + (
        "" if cfg.secagg_key_holder is None else
        f" plus the key holder (client {cfg.secagg_key_holder}, which knows its own upload)")
    asked = per_round(cfg.clients, cfg.participation)
    if asked < need:
        raise UsageError(f"secure aggregation would sum {asked} upload(s) per release, fewer "
                         f"than {minimum}: raise --clients or --participation")
    plan = cohort_plan(cfg)
    rows = secure_schedule(cfg, calibrator)
    if rows and min(len(r) for r in rows) < need:
        raise UsageError(f"secure aggregation would sum {min(len(r) for r in rows)} upload(s) "
                         f"per release, fewer than {minimum}: raise --clients or "
                         "--participation")
    if plan.smallest < need:
        raise UsageError(f"a cohort of {plan.smallest} client(s) is below {minimum}")
    check_schedule(rows, cfg.clients, cfg.secagg_min_clients, known=observers_own(cfg))


def build_protected_uplink(cfg, exp, calibrator) -> Uplink:
    """The uplink of a run with DP, secure aggregation or hidden counts; ``calibrator``
    declares the releases it protects (``release_plans``)."""
    from privfedcal.privacy.secagg_stage import SecAggStage

    if cfg.hide_counts and not cfg.secagg:
        raise UsageError("--hide-counts needs --secagg: only inside ciphertexts are counts "
                         "hidden")
    check_settings(cfg, exp)
    check_secure_aggregation(cfg, calibrator)
    warn_if_seeded(cfg.insecure_seeded_noise)
    if cfg.dp_train and not cfg.dp_enabled:
        raise UsageError("--dp-train needs a budget: give --dp-eps")
    if cfg.dp_train and not ALGORITHMS.get(cfg.local_method).dp_sgd:
        raise UsageError(f"--dp-train supports methods whose loss is a per-sample mean "
                         f"({', '.join(dpsgd_methods())}); {cfg.local_method} is not")
    dp_on = cfg.dp_enabled
    clip = cfg.dp_clip or (DP_DEFAULT_CLIP if dp_on else SECAGG_DEFAULT_CLIP)
    grad_clip = cfg.dp_grad_clip or DP_DEFAULT_GRAD_CLIP
    if not dp_on and cfg.dp_grad_clip is None:
        grad_clip = math.sqrt(2.0) * math.sqrt(clip * clip + 1.0)  # never binds: ||p - e_y|| <= sqrt 2
    bound = L2Clip({"feature": clip, "class-gradient": grad_clip})
    dp = None
    if dp_on:
        n_total = exp.num_examples  # public: federation/setup.py held_examples
        delta = cfg.dp_delta if cfg.dp_delta is not None else default_delta(n_total)
        plans = release_plans(cfg, calibrator)
        if not plans and not (cfg.dp_train or cfg.dp_updates):
            raise UsageError("--dp-eps has nothing to protect: no calibration uploads "
                             "(--method ccvr/creff or --calibrate ccvr), no --dp-train and "
                             "no --dp-updates")
        if cfg.dp_train:
            plans, sigmas = plan_with_dpsgd(cfg, exp, plans, delta)
        elif cfg.dp_updates:  # user level, q = 1 over the most rounds a client takes part in
            from privfedcal.privacy.user_dp import release_plan

            steps = max(participation_counts(cfg).values())
            plans = [*plans, release_plan(steps, cfg.dp_updates_share if plans else None)]
            sigmas = plan_noise(cfg.dp_eps, delta, plans, cfg.accountant)
        else:
            sigmas = plan_noise(cfg.dp_eps, delta, plans, cfg.accountant)
        dp = DPStage(target=cfg.dp_eps, delta=delta,
                     accountant=PrivacyAccountant(cfg.accountant, delta),
                     sigmas={p.name: s for p, s in zip(plans, sigmas, strict=True)},
                     rates={p.name: p.sample_rate for p in plans}, clip=clip,
                     grad_clip=grad_clip, distributed=cfg.secagg, covers_updates=cfg.dp_train,
                     planned=[{"name": p.name, "sample_rate": p.sample_rate, "steps": p.steps}
                              for p in plans],
                     planned_clients=planned_participants(cfg, calibrator),
                     specs={r.label: r for r in calibrator.releases})
        if cfg.dp_train:
            from privfedcal.privacy.dpsgd_local import verify_clients

            dp.steps[DPSGD_RELEASE] = plans[-1].steps // cfg.rounds
            uploads = [(z, p.sample_rate, p.steps) for p, z in zip(plans, sigmas, strict=True)
                       if p.name != DPSGD_RELEASE]
            verify_clients(cfg, exp, uploads, dp.sigmas[DPSGD_RELEASE], delta, cfg.dp_eps)
    if cfg.dp_train:
        import dataclasses

        from privfedcal.privacy.dpsgd_local import DPSGDSpec, nominal_size, schedule

        nominal = nominal_size(cfg, exp)
        q, steps = schedule(nominal, cfg.batch_size, cfg.local_epochs)
        exp.spec = dataclasses.replace(exp.spec, dp_sgd=DPSGDSpec(
            dp.sigmas[DPSGD_RELEASE], cfg.dp_grad_clip or DP_DEFAULT_GRAD_CLIP,
            sample_rate=q, steps=steps, expected_batch_size=q * nominal,
            seeded=cfg.insecure_seeded_noise))
    secagg = SecAggStage.for_run(cfg, exp, clip=clip, grad_clip=grad_clip, dp=dp,
                                 releases=calibrator.releases) if cfg.secagg else None
    if secagg is not None:  # CKKS parameters must exist for every release: fail before work
        from privfedcal.privacy.secagg import CKKSParams
        from privfedcal.privacy.secagg_stage import PRECISION

        for r in calibrator.releases:
            CKKSParams.for_magnitude(secagg.max_abs(r.label, r.keys), PRECISION,
                                     max_clients=cfg.clients)
    hints = calibrator.privacy_hints(cfg)
    up = Uplink(stages=uplink_stages(bound, dp, secagg, cfg), hide_counts=cfg.hide_counts,
                hints=hints, seeded_noise=cfg.insecure_seeded_noise)
    if cfg.dp_updates:
        up.user_dp = user_dp_of(cfg, dp)
    return up


def user_dp_of(cfg, dp):
    """``--dp-updates``: DP-FedAvg of the model updates (privacy/user_dp.py) with the noise
    plan ``dp``, its clip and its public denominator (the clients asked per round)."""
    from privfedcal.privacy.adaptive_clip import AdaptiveClip
    from privfedcal.privacy.user_dp import DEFAULT_UPDATE_CLIP, UserDP

    return UserDP(dp, cfg.dp_update_clip or DEFAULT_UPDATE_CLIP,
                  denominator=per_round(cfg.clients, cfg.participation),
                  distributed=cfg.secagg_updates, seed=cfg.seed,
                  seeded=cfg.insecure_seeded_noise,
                  adaptive=AdaptiveClip(cfg.dp_clip_quantile) if cfg.dp_adaptive_clip else None)


def uplink_stages(bound, dp, secagg, cfg) -> list[Stage]:
    """The run's stages in client order (bound, noise with a budget, ..., the wire): every
    registered stage builds itself from the plan (``privacy/stages.py`` ``planned_stages``)."""
    return planned_stages(StagePlan(cfg=cfg, bound=bound, dp=dp, secagg=secagg))


#: |parameter| assumed <= this under --secagg-updates: a data-independent bound for CKKS
#: (the shipped models' parameters stay far inside it); a sum past it fails the key
#: holder's check and the round keeps the previous global state (``skipped_releases``)
PARAM_BOUND = 100.0


def update_uplink(cfg, exp, uniform: bool) -> Uplink:
    """``--secagg-updates``: the model updates' own uplink, the same encrypt wire as the
    calibration releases (fresh keys per round, the key holder's minimum, flooding). Each
    client uploads ``w_k * state_k`` and ``w_k`` (``UPDATE_WEIGHT``); the bound of every
    entry is ``PARAM_BOUND`` times the largest possible weight sum."""
    from privfedcal.privacy.secagg_stage import EncryptStage, SecAggStage
    from privfedcal.privacy.uplink import UPDATE_WEIGHT

    weight_sum = float(cfg.clients) if uniform else float(exp.num_examples)  # public
    stage = SecAggStage(bounds={UPDATE_WEIGHT: weight_sum}, dp=None, clients=cfg.clients,
                        hide_counts=False, min_clients=secure_minimum(cfg),
                        default_bound=PARAM_BOUND * weight_sum + weight_sum,
                        cohorts=cohort_plan(cfg).cohorts)
    return Uplink(stages=[EncryptStage(stage)])


def build_uplink(cfg, exp, calibrator) -> Uplink:
    """The uplink a configuration asks for; ``calibrator`` (its class or object) declares
    the releases to protect."""
    if not (cfg.dp_enabled or cfg.secagg or cfg.hide_counts or cfg.dp_train
            or cfg.secagg_updates):
        return Uplink()
    up = build_protected_uplink(cfg, exp, calibrator)
    if cfg.secagg_updates:
        uniform = any(s.uniform_weights for s in up.stages)  # weights 1 under --dp-train
        up.updates = update_uplink(cfg, exp, uniform)
    return up


__all__ = ["ASSUMPTIONS", "DPStage", "build_protected_uplink", "build_uplink",
           "dpsgd_methods",
           "participation_counts", "planned_participants", "release_plans", "secure_schedule",
           "update_uplink", "user_dp_of"]
