"""Build the protected uplink of a run: plan the DP noise, set up CKKS, check the combination.

What each flag protects (docs/privacy.md has the whole story):
- ``--dp-eps``: sample-level (epsilon, delta)-DP of the calibration uploads (features clipped
  to ``--dp-clip``, per-sample class gradients to ``--dp-grad-clip``), composed over every
  release by one accountant; with ``--dp-train`` also of the model updates (DP-SGD).
- ``--secagg``: the server sees ciphertexts and the decrypted sum only (CKKS, TenSEAL).
- ``--hide-counts``: uploads have one shape whatever classes a client holds; counts and
  CReFF's holder indicators travel inside the ciphertexts (or DP-noised without secagg).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import PrivacyAccountant, ReleasePlan, plan_noise
from privfedcal.privacy.dp import (
    L2Clip,
    default_delta,
    gaussian_mechanism,
    noise_stds,
    payload_sensitivities,
)
from privfedcal.privacy.noise import warn_if_seeded
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.stages import BoundStage, ClearWire, NoiseStage, Stage
from privfedcal.privacy.uplink import Uplink
from privfedcal.seeding import select_clients

#: feature bound when secure aggregation runs without DP (CKKS needs a magnitude bound;
#: features of the shipped models are far inside it, so it rarely clips anything)
SECAGG_DEFAULT_CLIP = 1000.0
#: default feature bound R under DP (data-independent; the digits MLP's feature norms have a
#: median near 12, so 10 clips about half of them: tune --dp-clip for other models)
DP_DEFAULT_CLIP = 10.0
DP_DEFAULT_GRAD_CLIP = 1.0
#: methods whose local loss is a mean of per-sample terms (what DP-SGD can make private)
DPSGD_METHODS = ("fedavg", "fedavgm", "freeze")


#: what every epsilon this module reports assumes (summary.json, docs/privacy.md)
ASSUMPTIONS = [
    "sample-level DP: neighbouring datasets differ in one training example of one client",
    "per-client accounting over the releases the client took part in, q = 1 (no "
    "amplification by client sampling: the server chooses and sees the participants)",
    "DP-SGD's Poisson batches are drawn on the client from OS entropy: amplification by "
    "that subsampling is used (the server never sees the batches)",
    "noise drawn from OS entropy (no --insecure-seeded-noise)",
    "with --secagg and distributed noise: the key holder does not collude with the server",
]


@dataclass
class DPStage:
    """Noise of the uploads and the run's accounting: one accountant PER CLIENT.

    A release touches the examples of the clients asked for it only, so each client's
    epsilon composes the releases it took part in; the run reports the largest. No release
    is amplified by client sampling: the server chooses the participants (from the public
    seed) and the transcript names them, so a participating client is accounted at q = 1.
    ``accountant`` logs every release of the run (the summary's list).
    """

    target: float
    delta: float
    accountant: PrivacyAccountant
    sigmas: dict[str, float]
    rates: dict[str, float]
    clip: float
    grad_clip: float
    distributed: bool
    covers_updates: bool
    planned: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # steps per release (DP-SGD: per round)
    planned_clients: dict[str, int] = field(default_factory=dict)  # participants per release
    specs: dict[str, Any] = field(default_factory=dict)  # label -> releases.ReleaseSpec
    per_client: dict[int, PrivacyAccountant] = field(default_factory=dict)

    def _noise_multiplier(self, label: str) -> float:
        """The planned noise multiplier z of ``label`` (refused if it was never planned)."""
        if label not in self.sigmas:
            raise UsageError(f"release {label!r} was not planned in the privacy budget; "
                             "refusing to release it")
        return self.sigmas[label]

    def _acc(self, client: int) -> PrivacyAccountant:
        if client not in self.per_client:
            self.per_client[client] = PrivacyAccountant(self.accountant.kind, self.delta)
        return self.per_client[client]

    def _distinct(self, clients) -> list[PrivacyAccountant]:
        """One accountant per distinct history among ``clients`` (None: the run as one)."""
        reps: dict[str, PrivacyAccountant] = {}
        for c in ([-1] if clients is None else clients):
            acc = self._acc(int(c))
            reps.setdefault(repr(acc.state_dict()["history"]), acc)
        return list(reps.values())

    def check(self, label: str, clients=None) -> None:
        """Refuse (PrivacyBudgetError) a release that would push any of ``clients`` past the
        budget; call before the release."""
        for acc in self._distinct(clients):
            acc.check_release(self._noise_multiplier(label), self.rates[label], self.steps.get(label, 1),
                              target=self.target)

    def record(self, label: str, clients=None) -> None:
        z, q, t = self._noise_multiplier(label), self.rates[label], self.steps.get(label, 1)
        for c in ([-1] if clients is None else clients):
            self._acc(int(c)).record(z, q, t, label=label)
        self.accountant.record(z, q, t, label=label)

    def epsilon(self) -> float:
        """The largest epsilon any client has spent (0 before any release)."""
        return max((a.epsilon() for a in self._distinct(list(self.per_client))), default=0.0)

    def share(self, label: str) -> float:
        """Each client's share of the noise variance. Distributed noise (secure aggregation):
        ``1/(n - 1)`` for the n planned participants, so that the sum carries the full
        variance even for one participant (the key holder's node) that knows its own share."""
        if not self.distributed:
            return 1.0
        n = self.planned_clients.get(label, 0)
        return 1.0 if n <= 2 else 1.0 / (n - 1)

    def topup_share(self, label: str, arrived: int) -> float:
        """Variance the key holder adds when only ``arrived`` of the planned uploads made it
        into the sum (0 if none is missing): what the missing clients' shares would have been,
        so the server always sees at least the full variance."""
        if not self.distributed:
            return 0.0
        n = self.planned_clients.get(label, arrived)
        missing = max(0, n - arrived)
        return min(1.0, missing * self.share(label)) if missing else 0.0

    def sensitivities(self, keys, label: str | None = None) -> dict[str, float]:
        """From the release's declaration (its calibrator's file); the standard table for
        releases without one."""
        spec = self.specs.get(label) if label is not None else None
        if spec is not None:
            return spec.sensitivities(keys, clip=self.clip, grad_clip=self.grad_clip)
        return payload_sensitivities(keys, clip=self.clip, grad_clip=self.grad_clip)

    def noise(self, payload: dict[str, Tensor], label: str, generator, share: float) -> dict:
        return gaussian_mechanism(payload, self.sensitivities(payload, label), self._noise_multiplier(label),
                                  generator, share=share)

    def stds(self, keys, label: str) -> dict[str, float]:
        return noise_stds(self.sensitivities(keys, label), self._noise_multiplier(label))

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(),
                "clients": {str(c): a.state_dict() for c, a in self.per_client.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.per_client = {}
        for c, st in state.get("clients", {}).items():
            self._acc(int(c)).load_state_dict(st)

    def summary(self) -> dict[str, Any]:
        uploads = any(label != DPSGD_RELEASE for label in self.sigmas)
        covers = " and ".join(
            [w for w, on in (("calibration uploads", uploads),
                             ("model updates (DP-SGD)", self.covers_updates)) if on])
        if not self.covers_updates:
            covers += " only"
        spent = self.epsilon()
        statement = (f"({spent:.3f}, {self.delta:.2g})-DP per example, sample level, for the "
                     f"worst-off client, spent of epsilon {self.target:g} "
                     f"({self.accountant.kind}); covers {covers}; no amplification by client "
                     "sampling (the server chooses and sees the participants); assumes the "
                     "noise stays secret (drawn from OS entropy) and, with --secagg, a key "
                     "holder that does not collude with the server")
        if not self.covers_updates:
            statement += ". Model updates are NOT differentially private (no --dp-train)."
        return {"epsilon_spent": spent, "epsilon_target": self.target, "delta": self.delta,
                "accountant": self.accountant.kind, "covers": covers,
                "noise_multipliers": dict(self.sigmas), "sample_rates": dict(self.rates),
                "feature_clip": self.clip, "grad_clip": self.grad_clip,
                "distributed_noise": self.distributed, "releases": self.accountant.releases,
                "per_client_epsilon": {str(c): a.epsilon() for c, a in
                                       sorted(self.per_client.items()) if c >= 0},
                "assumptions": ASSUMPTIONS, "statement": statement}


def participation_counts(cfg) -> dict[int, int]:
    """Rounds each client is selected in: the server's choice, a function of the public
    config (``seeding.select_clients``), known before training."""
    counts = dict.fromkeys(range(cfg.clients), 0)
    for r in range(1, cfg.rounds + 1):
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
    clients), over the most rounds any client takes part in for per-round releases.

    ``calibrator`` is the run's calibrator (class or object: ``name``, ``releases``,
    ``protectable``), looked up by ``experiment.calibrator_class``."""
    if not calibrator.protectable:
        raise UsageError(f"the {calibrator.name} calibrator re-trains on raw features of every "
                         "client: it is an upper bound, not a protocol, and cannot be combined "
                         "with DP")
    plans = []
    for r in calibrator.releases:
        steps = 1 if r.participants == "all" else max(participation_counts(cfg).values())
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


def check_secure_aggregation(cfg, calibrator) -> None:
    """Refuse secure aggregation that protects nothing, or whose plan can sum fewer uploads
    than ``--secagg-min-clients`` (an aggregate of one is that client's upload)."""
    releases = list(getattr(calibrator, "releases", ()))
    if cfg.secagg and not releases:
        raise UsageError(f"--secagg protects calibration uploads, and {cfg.method} with "
                         f"--calibrate {cfg.calibrate} uploads none: use --secagg-updates to "
                         "hide the model updates")
    per_round = min(max(1, int(round(cfg.participation * cfg.clients))), cfg.clients)
    sums = []
    if cfg.secagg:
        sums += [cfg.clients if r.participants == "all" else per_round for r in releases]
    if cfg.secagg_updates:
        sums.append(per_round)
    if sums and min(sums) < cfg.secagg_min_clients:
        raise UsageError(f"secure aggregation would sum {min(sums)} upload(s) per release, "
                         f"fewer than --secagg-min-clients {cfg.secagg_min_clients}: raise "
                         "--clients or --participation")


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
    if cfg.dp_train and cfg.local_method not in DPSGD_METHODS:
        raise UsageError(f"--dp-train supports methods whose loss is a per-sample mean "
                         f"({', '.join(DPSGD_METHODS)}); {cfg.local_method} is not")
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
        if not plans and not cfg.dp_train:
            raise UsageError("--dp-eps has nothing to protect: no calibration uploads "
                             "(--method ccvr/creff or --calibrate ccvr) and no --dp-train")
        if cfg.dp_train:
            plans, sigmas = plan_with_dpsgd(cfg, exp, plans, delta)
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
    hints = []
    if dp_on and cfg.calibrator == "creff" and dp_creff_weighting(cfg) == "sample" and \
            not _weighting_given(cfg):
        hints.append("under DP, CReFF uses sample weighting (class-gradient sums and counts): "
                     "the paper's client weighting uploads per-class means whose signal does "
                     "not grow with the data and drowns in the noise (docs/results.md)")
    elif dp_on and cfg.calibrator == "creff" and dp_creff_weighting(cfg) != "sample":
        hints.append("CReFF's client weighting uploads per-class means, whose signal does not "
                     "grow with the data: under DP, --creff-weighting sample is far more "
                     "accurate (docs/results.md)")
    return Uplink(stages=uplink_stages(bound, dp, secagg, cfg), hide_counts=cfg.hide_counts,
                  hints=hints, seeded_noise=cfg.insecure_seeded_noise)


def uplink_stages(bound, dp, secagg, cfg) -> list[Stage]:
    """The run's stages in client order: bound, noise (with a budget), then the wire."""
    from privfedcal.privacy.secagg_stage import EncryptStage

    stages: list[Stage] = [BoundStage(bound)]
    if dp is not None:
        stages.append(NoiseStage(dp, seed=cfg.seed, seeded=cfg.insecure_seeded_noise))
    stages.append(EncryptStage(secagg) if secagg is not None else ClearWire())
    return stages


def _weighting_given(cfg) -> bool:
    return any(k in cfg.calibration_params for k in ("creff_weighting", "weighting"))


def dp_creff_weighting(cfg) -> str:
    """CReFF's weighting: the one given, else ``sample`` under DP (the one that survives the
    noise) and the paper's ``client`` otherwise."""
    given = cfg.calibration_params.get("creff_weighting") or cfg.calibration_params.get(
        "weighting")
    if given:
        return str(given)
    return "sample" if cfg.dp_enabled else "client"


def calibration_defaults(cfg, options: dict[str, Any]) -> dict[str, Any]:
    """Calibrator options with the privacy-dependent defaults filled in (CReFF under DP)."""
    if cfg.calibrator == "creff" and cfg.dp_enabled and not _weighting_given(cfg):
        return {**options, "creff_weighting": "sample"}
    return options
