"""The protection planner: a pure function from a run's privacy options to its plan.

``protection_inputs`` gathers, once, at the top, what the planner reads: the run's
``PrivacyOptions`` (privfedcal/settings/floors.py, the experiment's ``exp.privacy``), the
releases its calibrator declares with the rounds it makes them in, and the federation's
public number of training examples (``ProtectionInputs``, privacy/plan.py). ``plan_protection`` turns those
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
from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import ReleasePlan, plan_noise
from privfedcal.privacy.cohorts import (
    check_schedule,
    cohort_plan,
    observers_own,
    per_round,
    secure_minimum,
    select_clients,
)
from privfedcal.privacy.dp import default_delta
from privfedcal.privacy.dp_accounting import ASSUMPTIONS, DPAccounting
from privfedcal.privacy.executor import execute_plan, training_spec
from privfedcal.privacy.plan import (
    CKKSPlan,
    NoisePlan,
    PresetNoise,
    ProtectionInputs,
    ProtectionPlan,
    ReleaseSchedule,
    UserDPPlan,
)
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.secagg_updates import UPDATE_WEIGHT
from privfedcal.privacy.stage_registry import Shared, get_stage, plan_stages
from privfedcal.privacy.update_stage import UpdateStage, join_stages
from privfedcal.privacy.uplink import Uplink
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.settings.messages import SettingError, SettingText

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


def protection_inputs(privacy: PrivacyOptions, calibrator: Any, examples: int | None = None,
                      preset: PresetNoise | None = None) -> ProtectionInputs:
    """What the planner reads, gathered from the top: the run's ``PrivacyOptions``
    (``privacy``, e.g. ``exp.privacy``; ``PrivacyOptions.of(cfg)`` from a whole config), the
    releases ``calibrator`` (class or object) declares with the rounds it makes them in
    (its ``release_rounds`` reads the options' rounds and calibration parameters),
    ``examples``, the federation's public N (``federation/setup.py`` ``held_examples``),
    and noise planned beside the planner (``preset``: the Flower plugin's clip search)."""
    releases = tuple(
        ReleaseSchedule(r, () if r.participants == "all"
                        else tuple(calibrator.release_rounds(privacy, r)))
        for r in calibrator.releases)
    return ProtectionInputs(privacy,
                            examples=None if examples is None else int(examples),
                            releases=releases, protectable=bool(calibrator.protectable),
                            hints=tuple(calibrator.privacy_hints(privacy)), preset=preset)


def dpsgd_methods() -> tuple[str, ...]:
    """Methods whose local loss is a mean of per-sample terms (what DP-SGD can make
    private): each declares it (``Algorithm.dp_sgd``)."""
    return tuple(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).dp_sgd)


def participation_counts(privacy: Any, rounds=None) -> dict[int, int]:
    """Rounds each client is selected in (among ``rounds``, default every round): the
    server's choice, a function of the public options (``cohorts.select_clients``;
    ``privacy``: the run's ``PrivacyOptions``), known before training."""
    counts = dict.fromkeys(range(privacy.clients), 0)
    for r in (range(1, privacy.rounds + 1) if rounds is None else rounds):
        for c in select_clients(privacy, r):
            counts[c] += 1
    return counts


def planned_participants(inputs: ProtectionInputs) -> dict[str, int]:
    """Clients asked for each declared release (from the options, never from the server's
    messages): every client, or each round's selection."""
    p = inputs.privacy
    m = per_round(p.clients, p.participation)
    return {s.spec.label: p.clients if s.spec.participants == "all" else m
            for s in inputs.releases}


def release_plans(inputs: ProtectionInputs) -> list[ReleasePlan]:
    """The releases the run will make, from its calibrator's declarations, for the
    accountant's plan: per client, q = 1 (no amplification from the server's choice of
    clients), over the most rounds any client takes part in for per-round releases (among
    the rounds the calibrator makes them in: public options only)."""
    p = inputs.privacy
    if not inputs.protectable:
        raise UsageError(f"the {p.calibrator} calibrator re-trains on raw features of every "
                         "client: it is an upper bound, not a protocol, and cannot be combined "
                         "with DP")
    plans = []
    for s in inputs.releases:
        steps = 1 if s.spec.participants == "all" else max(
            participation_counts(p, s.rounds).values(), default=0)
        if steps < 1:
            continue  # a schedule without any round releases nothing: nothing to charge
        plans.append(ReleasePlan(s.spec.label, 1.0, steps))
    return plans


def check_flags(inputs: ProtectionInputs) -> None:
    """Refuse combinations whose guarantee would not hold or would crash later, given the
    method and the federation's size (a combination of flags alone is refused by the
    privacy section, privfedcal/settings/privacy_section.py)."""
    p = inputs.privacy
    if p.dp_train and not ALGORITHMS.get(p.local_method).dp_sgd:
        raise SettingError("{dp_train} supports methods whose loss is a per-sample mean "
                           "({methods}); {method_name} is not",
                           methods=", ".join(dpsgd_methods()), method_name=p.local_method)
    n_total = examples_of(inputs)
    f32 = 3.0e38  # features and payload sums are float32 on the client
    for name, value in (("dp_clip", p.dp_clip), ("dp_grad_clip", p.dp_grad_clip)):
        if value is None:
            continue
        if not math.isfinite(value) or value * value * max(n_total, 1) * 1e3 > f32:
            raise SettingError("{clip} is too large: its square times the {n} training "
                               "examples overflows float32 sums (the sensitivity of sum z z^T "
                               "is R^2)", n=n_total,
                               clip=SettingText("{dp_clip=:g}", dp_clip=value) if name == "dp_clip"
                               else SettingText("{dp_grad_clip=:g}", dp_grad_clip=value))
    if p.dp_enabled and p.dp_delta is not None and p.dp_delta >= 1.0 / max(n_total, 1):
        raise SettingError("{dp_delta=:g} must be < 1/N = {bound:.3g} (N = {n} training "
                           "examples): a mechanism that publishes one random example outright "
                           "is (0, 1/N)-DP", dp_delta=p.dp_delta, bound=1.0 / n_total, n=n_total)


def examples_of(inputs: ProtectionInputs) -> int:
    if inputs.examples is None:
        raise UsageError("the protection plan needs the federation's number of training "
                         "examples (public): protection_inputs(..., examples=N)")
    return inputs.examples


def secure_schedule(inputs: ProtectionInputs) -> list[list[int]]:
    """The participants of every securely summed release the plan makes, in order: each
    round's selection for per-round releases and for the model updates under
    --secagg-updates, every client for a release made once."""
    p = inputs.privacy
    releases = list(inputs.releases) if p.secagg else []
    rows: list[list[int]] = []
    for r in range(1, p.rounds + 1):
        chosen = select_clients(p, r)
        if p.secagg_updates:
            rows.append(chosen)
        rows += [chosen for s in releases if s.spec.participants != "all" and r in s.rounds]
    rows += [list(range(p.clients)) for s in releases if s.spec.participants == "all"]
    return rows


def check_secure_aggregation(inputs: ProtectionInputs) -> None:
    """Refuse secure aggregation that protects nothing, or whose plan can sum fewer uploads
    than ``--secagg-min-clients`` (an aggregate of one is that client's upload), in one
    release or in any combination of the run's releases (``cohorts.isolated_group`` on the
    planned schedule: rounds select whole cohorts, so this holds by construction and the
    check guards the construction)."""
    p = inputs.privacy
    if p.secagg and not inputs.releases:
        raise SettingError("{secagg} protects calibration uploads, and {method_name} with "
                           "{calibrate=} uploads none: use {secagg_updates} to hide the model "
                           "updates", method_name=p.method, calibrate=p.calibrator)
    if not p.secure:
        return
    need = secure_minimum(p)
    minimum = SettingText("{secagg_min_clients=}{holder}", secagg_min_clients=p.secagg_min_clients,
                          holder="" if p.secagg_key_holder is None else
                          f" plus the key holder (client {p.secagg_key_holder}, which knows its "
                          "own upload)")
    asked = per_round(p.clients, p.participation)
    if asked < need:
        raise SettingError("secure aggregation would sum {asked} upload(s) per release, fewer "
                           "than {minimum}: raise {clients} or {participation}", asked=asked,
                           minimum=minimum)
    plan = cohort_plan(p)
    rows = secure_schedule(inputs)
    if rows and min(len(r) for r in rows) < need:
        raise SettingError("secure aggregation would sum {summed} upload(s) per release, "
                           "fewer than {minimum}: raise {clients} or {participation}",
                           summed=min(len(r) for r in rows), minimum=minimum)
    if plan.smallest < need:
        raise SettingError("a cohort of {smallest} client(s) is below {minimum}",
                           smallest=plan.smallest, minimum=minimum)
    check_schedule(rows, p.clients, p.secagg_min_clients, known=observers_own(p))


def clip_bounds(inputs: ProtectionInputs) -> dict[str, float]:
    """The per-sample L2 bounds by row kind (privacy/dp.py ``L2Clip``): ``--dp-clip`` for
    features, ``--dp-grad-clip`` for class gradients; without DP, bounds that only size
    CKKS and never bind on gradients (||p - e_y|| <= sqrt 2)."""
    p = inputs.privacy
    clip = p.dp_clip or (DP_DEFAULT_CLIP if p.dp_enabled else SECAGG_DEFAULT_CLIP)
    grad_clip = p.dp_grad_clip or DP_DEFAULT_GRAD_CLIP
    if not p.dp_enabled and p.dp_grad_clip is None:
        grad_clip = math.sqrt(2.0) * math.sqrt(clip * clip + 1.0)
    return {"feature": clip, "class-gradient": grad_clip}


def noise_plan(inputs: ProtectionInputs, clips: dict[str, float]) -> NoisePlan:
    """The noise multiplier of every release for the run's budget (one accountant over the
    uploads, DP-SGD's steps or DP-FedAvg's rounds); DP-SGD's clients checked against it."""
    from privfedcal.privacy.dpsgd_local import client_rates, verify_clients

    p = inputs.privacy
    delta = p.dp_delta if p.dp_delta is not None else default_delta(examples_of(inputs))
    plans = release_plans(inputs)
    if not plans and not (p.dp_train or p.dp_updates):
        raise SettingError("{dp_eps} has nothing to protect: no calibration uploads "
                         "({method} ccvr/creff or {calibrate} ccvr), no {dp_train} and "
                         "no {dp_updates}")
    steps: dict[str, int] = {}
    if p.dp_train:  # every client runs one public schedule, so one plan covers them all
        share = p.dp_train_share if plans else None  # alone, DP-SGD gets the whole budget
        ((q, per_round_steps),) = client_rates(p, examples_of(inputs))
        plans = [*plans, ReleasePlan(DPSGD_RELEASE, q, per_round_steps * p.rounds,
                                     share=share)]
        steps[DPSGD_RELEASE] = per_round_steps
    elif p.dp_updates:  # user level, q = 1 over the most rounds a client takes part in
        from privfedcal.privacy.user_dp import release_plan

        plans = [*plans, release_plan(max(participation_counts(p).values()),
                                      p.dp_updates_share if plans else None)]
    sigmas = plan_noise(p.dp_eps, delta, plans, p.accountant)
    by_label = {r.name: z for r, z in zip(plans, sigmas, strict=True)}
    if inputs.preset is not None:
        by_label, plans = with_preset(inputs.preset, p.dp_eps, delta, by_label, plans)
    if p.dp_train:
        uploads = [(by_label[r.name], r.sample_rate, r.steps) for r in plans
                   if r.name != DPSGD_RELEASE]
        verify_clients(p, examples_of(inputs), uploads, by_label[DPSGD_RELEASE], delta,
                       p.dp_eps)
    return NoisePlan(target=p.dp_eps, delta=delta, accountant=p.accountant,
                     sigmas=by_label, rates={r.name: r.sample_rate for r in plans},
                     clip=clips["feature"], grad_clip=clips["class-gradient"],
                     distributed=p.secagg, covers_updates=p.dp_train,
                     planned=tuple({"name": r.name, "sample_rate": r.sample_rate,
                                    "steps": r.steps} for r in plans),
                     steps=steps, planned_clients=planned_participants(inputs),
                     specs={s.spec.label: s.spec for s in inputs.releases})


def dpsgd_spec(inputs: ProtectionInputs, noise: NoisePlan) -> Any:
    """DP-SGD's public local schedule (privacy/dpsgd_local.py) at the planned noise."""
    from privfedcal.privacy.dpsgd_local import DPSGDSpec, nominal_size, schedule

    p = inputs.privacy
    nominal = nominal_size(p, examples_of(inputs))
    q, steps = schedule(nominal, p.batch_size, p.local_epochs)
    return DPSGDSpec(noise.sigmas[DPSGD_RELEASE], p.dp_grad_clip or DP_DEFAULT_GRAD_CLIP,
                     sample_rate=q, steps=steps, expected_batch_size=q * nominal,
                     seeded=p.insecure_seeded_noise)


def ckks_plan(inputs: ProtectionInputs, clips: dict[str, float],
              noise: NoisePlan | None) -> CKKSPlan:
    """The calibration uploads' CKKS set-up: bounds and symmetric keys from the releases'
    declarations only (privacy/releases.py; a key two releases share gets the larger
    bound). CKKS parameters must exist for every release: refused here, before any work."""
    from privfedcal.privacy.secagg import CKKSParams
    from privfedcal.privacy.secagg_stage import PRECISION, CKKSSettings

    p = inputs.privacy
    n, k = float(examples_of(inputs)), float(p.clients)
    bounds: dict[str, float] = {}
    for s in inputs.releases:
        for key, b in s.spec.bounds(clip=clips["feature"], grad_clip=clips["class-gradient"],
                                    examples=n, clients=k).items():
            bounds[key] = max(bounds.get(key, 0.0), b)
    plan = CKKSPlan(bounds=bounds, clients=p.clients, min_clients=secure_minimum(p),
                    hide_counts=p.hide_counts, cohorts=cohort_plan(p).cohorts,
                    symmetric={s.spec.label: s.spec.symmetric for s in inputs.releases},
                    known=observers_own(p))
    sizing = CKKSSettings.from_plan(plan, dp=noise.live() if noise is not None else None)
    for s in inputs.releases:
        CKKSParams.for_magnitude(sizing.max_abs(s.spec.label, s.spec.keys), PRECISION,
                                 max_clients=p.clients)
    return plan


def updates_plan(inputs: ProtectionInputs) -> CKKSPlan:
    """``--secagg-updates``: each client uploads ``w_k * state_k`` and ``w_k``
    (``UPDATE_WEIGHT``); every entry is bounded by ``PARAM_BOUND`` times the largest possible
    weight sum (the clients under --dp-train's uniform weights, else N)."""
    p = inputs.privacy
    weight_sum = float(p.clients) if p.dp_train else float(examples_of(inputs))
    return CKKSPlan(bounds={UPDATE_WEIGHT: weight_sum}, clients=p.clients,
                    min_clients=secure_minimum(p),
                    default_bound=PARAM_BOUND * weight_sum + weight_sum,
                    cohorts=cohort_plan(p).cohorts, known=observers_own(p))


def user_dp_plan(privacy: Any) -> UserDPPlan:
    """``--dp-updates``: DP-FedAvg's clip and public denominator (the clients asked per
    round); ``privacy``: the run's ``PrivacyOptions``."""
    from privfedcal.privacy.user_dp import DEFAULT_UPDATE_CLIP

    return UserDPPlan(clip=privacy.dp_update_clip or DEFAULT_UPDATE_CLIP,
                      denominator=per_round(privacy.clients, privacy.participation),
                      distributed=privacy.secagg_updates, seed=privacy.seed,
                      seeded=privacy.insecure_seeded_noise,
                      adaptive_quantile=privacy.dp_clip_quantile if privacy.dp_adaptive_clip
                      else None)


def user_dp_of(privacy: Any, dp: DPAccounting) -> Any:
    """The live DP-FedAvg of ``privacy`` charged to ``dp`` (the run's noise plan), joined
    with the other update stages its plan switches on (its clip policy, where
    ``--dp-adaptive-clip`` plans one), as the uplink joins them."""
    from privfedcal.privacy.user_dp import UserDP

    plan = plan_stages(ProtectionPlan(ProtectionInputs(privacy), protected=True,
                                      user_dp=user_dp_plan(privacy)))
    shared = Shared(dp=dp)
    built = [get_stage(name).build(setup, shared) for name, setup in plan.stages
             if get_stage(name).updates]
    stages = join_stages([s for s in built if isinstance(s, UpdateStage)])
    return next(s for s in stages if isinstance(s, UserDP))


def plan_protection(inputs: ProtectionInputs) -> ProtectionPlan:
    """The run's protection plan: a pure function of ``inputs`` (the same inputs, the same
    plan; nothing read or written elsewhere). Raises ``UsageError`` (``PrivacyBudgetError``)
    for settings whose guarantee would not hold, before any work."""
    p = inputs.privacy
    if not (inputs.protected or inputs.stages):
        return ProtectionPlan(inputs)
    check_flags(inputs)
    check_secure_aggregation(inputs)
    clips = clip_bounds(inputs) if inputs.protected else {}
    noise = noise_plan(inputs, clips) if p.dp_enabled else None
    plan = ProtectionPlan(
        inputs, protected=True, clips=clips, noise=noise,
        ckks=ckks_plan(inputs, clips, noise) if p.secagg else None,
        updates=updates_plan(inputs) if p.secagg_updates else None,
        dp_sgd=dpsgd_spec(inputs, noise) if noise is not None and p.dp_train else None,
        user_dp=user_dp_plan(p) if p.dp_updates else None, hints=inputs.hints)
    return plan_stages(plan)


def with_preset(preset: PresetNoise, target: float, delta: float, sigmas: dict[str, float],
                plans: list[ReleasePlan]) -> tuple[dict[str, float], list[ReleasePlan]]:
    """The run's multipliers replaced by ``preset``'s, planned for the same releases and
    budget, and its extra releases added; a preset for other releases or another budget
    is refused."""
    if set(preset.sigmas) != set(sigmas) or preset.target != target or preset.delta != delta:
        raise UsageError(f"the preset noise ({sorted(preset.sigmas)}, epsilon "
                         f"{preset.target:g}) is not the run's ({sorted(sigmas)}, epsilon "
                         f"{target:g})")
    out = {**sigmas, **preset.sigmas, **{label: z for label, z, _, _ in preset.extra}}
    return out, [*plans, *(ReleasePlan(label, q, t) for label, _, q, t in preset.extra)]


def plan_for_run(privacy: PrivacyOptions, calibrator: Any, examples: int,
                 preset: PresetNoise | None = None) -> ProtectionPlan:
    """``plan_protection`` of a run's ``PrivacyOptions`` (``exp.privacy``): its inputs
    gathered once, here."""
    return plan_protection(protection_inputs(privacy, calibrator, examples, preset))


def build_uplink(cfg: Any, exp: Any, calibrator: Any) -> Uplink:
    """The live uplink of a run's plan, for callers that hold a ``RunConfig`` and run no
    local training (those take the plan's DP-SGD schedule too: ``training_spec``)."""
    return execute_plan(plan_for_run(PrivacyOptions.of(cfg), calibrator, exp.num_examples))


__all__ = ["ASSUMPTIONS", "DPAccounting", "ProtectionInputs", "ProtectionPlan", "build_uplink",
           "dpsgd_methods", "execute_plan", "participation_counts", "plan_for_run",
           "plan_protection", "planned_participants", "protection_inputs", "release_plans",
           "secure_schedule", "training_spec", "user_dp_of"]
