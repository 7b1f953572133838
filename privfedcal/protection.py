"""The protection planner: a pure function from a run's privacy options to its plan.

``protection_inputs`` gathers, once, at the top, what the planner reads: the run's
``PrivacyOptions`` (privfedcal/options.py, read from its ``RunConfig``), the releases its
calibrator declares with the rounds it makes them in, and the federation's public number of
training examples (``ProtectionInputs``, privacy/plan.py). ``plan_protection`` turns those
into a ``ProtectionPlan``: the DP noise of every release, the CKKS set-up, DP-SGD's
schedule, DP-FedAvg's clip and every registered stage's set-up, after the whole-run checks
(the combination of flags, the budget, the secure-aggregation schedule). It reads nothing
else and writes nothing: the same inputs give the same plan on the simulator, on every
Flower node and on the server, and privacy/executor.py ``execute_plan`` builds the live
uplink from it. This layer knows the methods and calibrators (whether a method's loss suits
DP-SGD); ``privacy/`` holds only the mechanisms.

What each flag protects (docs/privacy.md has the whole story):
- ``--dp-eps``: sample-level (epsilon, delta)-DP of the calibration uploads (features clipped
  to ``--dp-clip``, per-sample class gradients to ``--dp-grad-clip``), composed over every
  release by one accountant; with ``--dp-train`` also of the model updates (DP-SGD).
- ``--dp-updates``: user-level DP-FedAvg of the model updates (privacy/user_dp.py), charged
  to the same per-client accountants as the uploads.
- ``--secagg``: the server sees ciphertexts and the decrypted sum only (CKKS, TenSEAL).
- ``--hide-counts``: uploads have one shape whatever classes a client holds; counts and
  CReFF's holder indicators travel inside the ciphertexts (or DP-noised without secagg).
- ``--stages NAME,...``: opt-in stages registered by name (privacy/stage_registry.py).
"""

from __future__ import annotations

import math
from typing import Any

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
from privfedcal.options import PrivacyOptions
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.dp import default_delta
from privfedcal.privacy.dp_stage import ASSUMPTIONS, DPStage
from privfedcal.privacy.executor import execute_plan, live_user_dp, training_spec
from privfedcal.privacy.plan import (
    CKKSPlan,
    NoisePlan,
    ProtectionInputs,
    ProtectionPlan,
    ReleaseSchedule,
    UserDPPlan,
)
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.stage_registry import plan_stages
from privfedcal.privacy.uplink import UPDATE_WEIGHT, Uplink

#: feature bound when secure aggregation runs without DP (CKKS needs a magnitude bound;
#: features of the shipped models are far inside it, so it rarely clips anything)
SECAGG_DEFAULT_CLIP = 1000.0
#: default feature bound R under DP (data-independent; the digits MLP's feature norms have a
#: median near 12, so 10 clips about half of them: tune --dp-clip for other models)
DP_DEFAULT_CLIP = 10.0
DP_DEFAULT_GRAD_CLIP = 1.0
#: |parameter| assumed <= this under --secagg-updates: a data-independent bound for CKKS
#: (the shipped models' parameters stay far inside it); a sum past it fails the key
#: holder's check and the round keeps the previous global state (``skipped_releases``)
PARAM_BOUND = 100.0


def protection_inputs(cfg: Any, calibrator: Any,
                      examples: int | None = None) -> ProtectionInputs:
    """What the planner reads, gathered from the top: ``cfg``'s ``PrivacyOptions``, the
    releases ``calibrator`` (class or object) declares with the rounds it makes them in
    (its ``release_rounds`` reads the run's calibration settings), and ``examples``, the
    federation's public N (``federation/setup.py`` ``held_examples``)."""
    releases = tuple(
        ReleaseSchedule(r, () if r.participants == "all"
                        else tuple(calibrator.release_rounds(cfg, r)))
        for r in calibrator.releases)
    return ProtectionInputs(PrivacyOptions.of(cfg),
                            examples=None if examples is None else int(examples),
                            releases=releases, protectable=bool(calibrator.protectable),
                            hints=tuple(calibrator.privacy_hints(cfg)))


def dpsgd_methods() -> tuple[str, ...]:
    """Methods whose local loss is a mean of per-sample terms (what DP-SGD can make
    private): each declares it (``Algorithm.dp_sgd``)."""
    return tuple(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).dp_sgd)


def participation_counts(privacy: Any, rounds=None) -> dict[int, int]:
    """Rounds each client is selected in (among ``rounds``, default every round): the
    server's choice, a function of the public options (``cohorts.select_clients``; ``privacy``: the run's
    ``PrivacyOptions``, or a ``RunConfig``), known before training."""
    counts = dict.fromkeys(range(privacy.clients), 0)
    for r in (range(1, privacy.rounds + 1) if rounds is None else rounds):
        for c in select_clients(privacy, r):
            counts[c] += 1
    return counts


def planned_participants(opts: ProtectionInputs) -> dict[str, int]:
    """Clients asked for each declared release (from the options, never from the server's
    messages): every client, or each round's selection."""
    m = min(max(1, int(round(opts.privacy.participation * opts.privacy.clients))), opts.privacy.clients)
    return {s.spec.label: opts.privacy.clients if s.spec.participants == "all" else m
            for s in opts.releases}


def release_plans(opts: ProtectionInputs) -> list[ReleasePlan]:
    """The releases the run will make, from its calibrator's declarations, for the
    accountant's plan: per client, q = 1 (no amplification from the server's choice of
    clients), over the most rounds any client takes part in for per-round releases (among
    the rounds the calibrator makes them in: public options only)."""
    if not opts.protectable:
        raise UsageError(f"the {opts.privacy.calibrator} calibrator re-trains on raw features of every "
                         "client: it is an upper bound, not a protocol, and cannot be combined "
                         "with DP")
    plans = []
    for s in opts.releases:
        steps = 1 if s.spec.participants == "all" else max(
            participation_counts(opts.privacy, s.rounds).values(), default=0)
        if steps < 1:
            continue  # a schedule without any round releases nothing: nothing to charge
        plans.append(ReleasePlan(s.spec.label, 1.0, steps))
    return plans


def check_flags(opts: ProtectionInputs) -> None:
    """Refuse combinations whose guarantee would not hold or would crash later."""
    if opts.privacy.hide_counts and not opts.privacy.secagg:
        raise UsageError("--hide-counts needs --secagg: only inside ciphertexts are counts "
                         "hidden")
    if opts.privacy.dp_train and not opts.privacy.dp_enabled:
        raise UsageError("--dp-train needs a budget: give --dp-eps")
    if opts.privacy.dp_train and not ALGORITHMS.get(opts.privacy.local_method).dp_sgd:
        raise UsageError(f"--dp-train supports methods whose loss is a per-sample mean "
                         f"({', '.join(dpsgd_methods())}); {opts.privacy.local_method} is not")
    n_total = examples_of(opts)
    f32 = 3.0e38  # features and payload sums are float32 on the client
    for flag, value in (("--dp-clip", opts.privacy.dp_clip), ("--dp-grad-clip", opts.privacy.dp_grad_clip)):
        if value is None:
            continue
        if not math.isfinite(value) or value * value * max(n_total, 1) * 1e3 > f32:
            raise UsageError(f"{flag} {value:g} is too large: its square times the {n_total} "
                             "training examples overflows float32 sums (the sensitivity of "
                             "sum z z^T is R^2)")
    if opts.privacy.dp_enabled and opts.privacy.dp_delta is not None and opts.privacy.dp_delta >= 1.0 / max(n_total, 1):
        raise UsageError(f"--dp-delta {opts.privacy.dp_delta:g} must be < 1/N = {1.0 / n_total:.3g} "
                         f"(N = {n_total} training examples): a mechanism that publishes one "
                         "random example outright is (0, 1/N)-DP")


def examples_of(opts: ProtectionInputs) -> int:
    if opts.examples is None:
        raise UsageError("the protection plan needs the federation's number of training "
                         "examples (public): protection_inputs(..., examples=N)")
    return opts.examples


def secure_schedule(opts: ProtectionInputs) -> list[list[int]]:
    """The participants of every securely summed release the plan makes, in order: each
    round's selection for per-round releases and for the model updates under
    --secagg-updates, every client for a release made once."""
    releases = list(opts.releases) if opts.privacy.secagg else []
    rows: list[list[int]] = []
    for r in range(1, opts.privacy.rounds + 1):
        chosen = select_clients(opts.privacy, r)
        if opts.privacy.secagg_updates:
            rows.append(chosen)
        rows += [chosen for s in releases if s.spec.participants != "all" and r in s.rounds]
    rows += [list(range(opts.privacy.clients)) for s in releases if s.spec.participants == "all"]
    return rows


def check_secure_aggregation(opts: ProtectionInputs) -> None:
    """Refuse secure aggregation that protects nothing, or whose plan can sum fewer uploads
    than ``--secagg-min-clients`` (an aggregate of one is that client's upload), in one
    release or in any combination of the run's releases (``cohorts.isolated_group`` on the
    planned schedule: rounds select whole cohorts, so this holds by construction and the
    check guards the construction)."""
    if opts.privacy.secagg and not opts.releases:
        raise UsageError(f"--secagg protects calibration uploads, and {opts.privacy.method} with "
                         f"--calibrate {opts.privacy.calibrator} uploads none: use --secagg-updates "
                         "to hide the model updates")
    if not (opts.privacy.secagg or opts.privacy.secagg_updates):
        return
    need = secure_minimum(opts.privacy)
    minimum = f"--secagg-min-clients {opts.privacy.secagg_min_clients}" + (
        "" if opts.privacy.secagg_key_holder is None else
        f" plus the key holder (client {opts.privacy.secagg_key_holder}, which knows its own upload)")
    asked = per_round(opts.privacy.clients, opts.privacy.participation)
    if asked < need:
        raise UsageError(f"secure aggregation would sum {asked} upload(s) per release, fewer "
                         f"than {minimum}: raise --clients or --participation")
    plan = cohort_plan(opts.privacy)
    rows = secure_schedule(opts)
    if rows and min(len(r) for r in rows) < need:
        raise UsageError(f"secure aggregation would sum {min(len(r) for r in rows)} upload(s) "
                         f"per release, fewer than {minimum}: raise --clients or "
                         "--participation")
    if plan.smallest < need:
        raise UsageError(f"a cohort of {plan.smallest} client(s) is below {minimum}")
    check_schedule(rows, opts.privacy.clients, opts.privacy.secagg_min_clients, known=observers_own(opts.privacy))


def clip_bounds(opts: ProtectionInputs) -> dict[str, float]:
    """The per-sample L2 bounds by row kind (privacy/dp.py ``L2Clip``): ``--dp-clip`` for
    features, ``--dp-grad-clip`` for class gradients; without DP, bounds that only size
    CKKS and never bind on gradients (||p - e_y|| <= sqrt 2)."""
    clip = opts.privacy.dp_clip or (DP_DEFAULT_CLIP if opts.privacy.dp_enabled else SECAGG_DEFAULT_CLIP)
    grad_clip = opts.privacy.dp_grad_clip or DP_DEFAULT_GRAD_CLIP
    if not opts.privacy.dp_enabled and opts.privacy.dp_grad_clip is None:
        grad_clip = math.sqrt(2.0) * math.sqrt(clip * clip + 1.0)
    return {"feature": clip, "class-gradient": grad_clip}


def noise_plan(opts: ProtectionInputs, clips: dict[str, float]) -> NoisePlan:
    """The noise multiplier of every release for the run's budget (one accountant over the
    uploads, DP-SGD's steps or DP-FedAvg's rounds); DP-SGD's clients checked against it."""
    from privfedcal.privacy.dpsgd_local import client_rates, verify_clients

    delta = opts.privacy.dp_delta if opts.privacy.dp_delta is not None else default_delta(examples_of(opts))
    plans = release_plans(opts)
    if not plans and not (opts.privacy.dp_train or opts.privacy.dp_updates):
        raise UsageError("--dp-eps has nothing to protect: no calibration uploads "
                         "(--method ccvr/creff or --calibrate ccvr), no --dp-train and "
                         "no --dp-updates")
    steps: dict[str, int] = {}
    if opts.privacy.dp_train:  # every client runs one public schedule, so one plan covers them all
        share = opts.privacy.dp_train_share if plans else None  # alone, DP-SGD gets the whole budget
        ((q, per_round_steps),) = client_rates(opts.privacy, examples_of(opts))
        plans = [*plans, ReleasePlan(DPSGD_RELEASE, q, per_round_steps * opts.privacy.rounds,
                                     share=share)]
        steps[DPSGD_RELEASE] = per_round_steps
    elif opts.privacy.dp_updates:  # user level, q = 1 over the most rounds a client takes part in
        from privfedcal.privacy.user_dp import release_plan

        plans = [*plans, release_plan(max(participation_counts(opts.privacy).values()),
                                      opts.privacy.dp_updates_share if plans else None)]
    sigmas = plan_noise(opts.privacy.dp_eps, delta, plans, opts.privacy.accountant)
    by_label = {p.name: s for p, s in zip(plans, sigmas, strict=True)}
    if opts.privacy.dp_train:
        uploads = [(z, p.sample_rate, p.steps) for p, z in zip(plans, sigmas, strict=True)
                   if p.name != DPSGD_RELEASE]
        verify_clients(opts.privacy, examples_of(opts), uploads, by_label[DPSGD_RELEASE], delta,
                       opts.privacy.dp_eps)
    return NoisePlan(target=opts.privacy.dp_eps, delta=delta, accountant=opts.privacy.accountant,
                     sigmas=by_label, rates={p.name: p.sample_rate for p in plans},
                     clip=clips["feature"], grad_clip=clips["class-gradient"],
                     distributed=opts.privacy.secagg, covers_updates=opts.privacy.dp_train,
                     planned=tuple({"name": p.name, "sample_rate": p.sample_rate,
                                    "steps": p.steps} for p in plans),
                     steps=steps, planned_clients=planned_participants(opts),
                     specs={s.spec.label: s.spec for s in opts.releases})


def dpsgd_spec(opts: ProtectionInputs, noise: NoisePlan) -> Any:
    """DP-SGD's public local schedule (privacy/dpsgd_local.py) at the planned noise."""
    from privfedcal.privacy.dpsgd_local import DPSGDSpec, nominal_size, schedule

    nominal = nominal_size(opts.privacy, examples_of(opts))
    q, steps = schedule(nominal, opts.privacy.batch_size, opts.privacy.local_epochs)
    return DPSGDSpec(noise.sigmas[DPSGD_RELEASE], opts.privacy.dp_grad_clip or DP_DEFAULT_GRAD_CLIP,
                     sample_rate=q, steps=steps, expected_batch_size=q * nominal,
                     seeded=opts.privacy.insecure_seeded_noise)


def ckks_plan(opts: ProtectionInputs, clips: dict[str, float],
              noise: NoisePlan | None) -> CKKSPlan:
    """The calibration uploads' CKKS set-up: bounds and symmetric keys from the releases'
    declarations only (privacy/releases.py; a key two releases share gets the larger
    bound). CKKS parameters must exist for every release: refused here, before any work."""
    from privfedcal.privacy.secagg import CKKSParams
    from privfedcal.privacy.secagg_stage import PRECISION, SecAggStage

    n, k = float(examples_of(opts)), float(opts.privacy.clients)
    bounds: dict[str, float] = {}
    for s in opts.releases:
        for key, b in s.spec.bounds(clip=clips["feature"], grad_clip=clips["class-gradient"],
                                    examples=n, clients=k).items():
            bounds[key] = max(bounds.get(key, 0.0), b)
    plan = CKKSPlan(bounds=bounds, clients=opts.privacy.clients, min_clients=secure_minimum(opts.privacy),
                    hide_counts=opts.privacy.hide_counts, cohorts=cohort_plan(opts.privacy).cohorts,
                    symmetric={s.spec.label: s.spec.symmetric for s in opts.releases})
    sizing = SecAggStage.from_plan(plan, dp=noise.live() if noise is not None else None)
    for s in opts.releases:
        CKKSParams.for_magnitude(sizing.max_abs(s.spec.label, s.spec.keys), PRECISION,
                                 max_clients=opts.privacy.clients)
    return plan


def updates_plan(opts: ProtectionInputs) -> CKKSPlan:
    """``--secagg-updates``: each client uploads ``w_k * state_k`` and ``w_k``
    (``UPDATE_WEIGHT``); every entry is bounded by ``PARAM_BOUND`` times the largest possible
    weight sum (the clients under --dp-train's uniform weights, else N)."""
    weight_sum = float(opts.privacy.clients) if opts.privacy.dp_train else float(examples_of(opts))
    return CKKSPlan(bounds={UPDATE_WEIGHT: weight_sum}, clients=opts.privacy.clients,
                    min_clients=secure_minimum(opts.privacy),
                    default_bound=PARAM_BOUND * weight_sum + weight_sum,
                    cohorts=cohort_plan(opts.privacy).cohorts)


def user_dp_plan(opts: Any) -> UserDPPlan:
    """``--dp-updates``: DP-FedAvg's clip and public denominator (the clients asked per
    round); ``opts``: the run's ``PrivacyOptions`` (a ``RunConfig`` has the same fields)."""
    from privfedcal.privacy.user_dp import DEFAULT_UPDATE_CLIP

    return UserDPPlan(clip=opts.dp_update_clip or DEFAULT_UPDATE_CLIP,
                      denominator=per_round(opts.clients, opts.participation),
                      distributed=opts.secagg_updates, seed=opts.seed,
                      seeded=opts.insecure_seeded_noise,
                      adaptive_quantile=opts.dp_clip_quantile if opts.dp_adaptive_clip
                      else None)


def user_dp_of(opts: Any, dp: DPStage) -> Any:
    """The live DP-FedAvg of ``opts`` charged to ``dp`` (the run's noise plan)."""
    return live_user_dp(user_dp_plan(opts), dp)


def plan_protection(inputs: ProtectionInputs) -> ProtectionPlan:
    """The run's protection plan: a pure function of ``inputs`` (the same inputs, the same
    plan; nothing read or written elsewhere). Raises ``UsageError`` (``PrivacyBudgetError``)
    for settings whose guarantee would not hold, before any work."""
    opts = inputs
    if not (opts.protected or opts.stages):
        return ProtectionPlan(opts)
    check_flags(opts)
    check_secure_aggregation(opts)
    clips = clip_bounds(opts) if opts.protected else {}
    noise = noise_plan(opts, clips) if opts.privacy.dp_enabled else None
    plan = ProtectionPlan(
        opts, protected=True, clips=clips, noise=noise,
        ckks=ckks_plan(opts, clips, noise) if opts.privacy.secagg else None,
        updates=updates_plan(opts) if opts.privacy.secagg_updates else None,
        dp_sgd=dpsgd_spec(opts, noise) if noise is not None and opts.privacy.dp_train else None,
        user_dp=user_dp_plan(opts.privacy) if opts.privacy.dp_updates else None, hints=opts.hints)
    return plan_stages(plan)


def plan_for_run(cfg: Any, calibrator: Any, examples: int) -> ProtectionPlan:
    """``plan_protection`` of a ``RunConfig``: its inputs gathered once, here."""
    return plan_protection(protection_inputs(cfg, calibrator, examples))


def build_uplink(cfg: Any, exp: Any, calibrator: Any) -> Uplink:
    """The live uplink of a run's plan, for callers that hold a ``RunConfig`` and run no
    local training (those take the plan's DP-SGD schedule too: ``training_spec``)."""
    return execute_plan(plan_for_run(cfg, calibrator, exp.num_examples))


__all__ = ["ASSUMPTIONS", "DPStage", "ProtectionInputs", "ProtectionPlan", "build_uplink",
           "dpsgd_methods", "execute_plan", "participation_counts", "plan_for_run",
           "plan_protection", "planned_participants", "protection_inputs", "release_plans",
           "secure_schedule", "training_spec", "user_dp_of"]
