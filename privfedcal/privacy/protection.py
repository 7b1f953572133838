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
from privfedcal.privacy.dp import L2Clip, gaussian_mechanism, noise_stds, payload_sensitivities
from privfedcal.privacy.uplink import Uplink

#: release labels the calibrators use, with the payload keys they may carry
CCVR_RELEASE = "ccvr-stats"
CREFF_RELEASE = "creff-grad"
DPSGD_RELEASE = "dp-sgd"
#: feature bound when secure aggregation runs without DP (CKKS needs a magnitude bound;
#: features of the shipped models are far inside it, so it rarely clips anything)
SECAGG_DEFAULT_CLIP = 1000.0
#: default feature bound R under DP (data-independent; the digits MLP's feature norms have a
#: median near 12, so 10 clips about half of them: tune --dp-clip for other models)
DP_DEFAULT_CLIP = 10.0
DP_DEFAULT_GRAD_CLIP = 1.0
#: methods whose local loss is a mean of per-sample terms (what DP-SGD can make private)
DPSGD_METHODS = ("fedavg", "fedavgm", "freeze")


@dataclass
class DPStage:
    """Noise of the uploads and the run's accountant (one for every release)."""

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

    def _z(self, label: str) -> float:
        if label not in self.sigmas:
            raise UsageError(f"release {label!r} was not planned in the privacy budget; "
                             "refusing to release it")
        return self.sigmas[label]

    def check(self, label: str) -> None:
        self.accountant.check_release(self._z(label), self.rates[label],
                                      self.steps.get(label, 1), target=self.target)

    def record(self, label: str) -> None:
        self.accountant.record(self._z(label), self.rates[label], self.steps.get(label, 1),
                               label=label)

    def sensitivities(self, keys) -> dict[str, float]:
        return payload_sensitivities(keys, clip=self.clip, grad_clip=self.grad_clip)

    def noise(self, payload: dict[str, Tensor], label: str, generator, share: float) -> dict:
        return gaussian_mechanism(payload, self.sensitivities(payload), self._z(label),
                                  generator, share=share)

    def stds(self, keys, label: str) -> dict[str, float]:
        return noise_stds(self.sensitivities(keys), self._z(label))

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])

    def summary(self) -> dict[str, Any]:
        uploads = any(label != DPSGD_RELEASE for label in self.sigmas)
        covers = " and ".join(
            [w for w, on in (("calibration uploads", uploads),
                             ("model updates (DP-SGD)", self.covers_updates)) if on])
        if not self.covers_updates:
            covers += " only"
        spent = self.accountant.epsilon()
        statement = (f"({spent:.3f}, {self.delta:.2g})-DP spent of epsilon {self.target:g} "
                     f"({self.accountant.kind}); covers {covers}")
        if not self.covers_updates:
            statement += ". Model updates are NOT differentially private (no --dp-train)."
        return {"epsilon_spent": spent, "epsilon_target": self.target, "delta": self.delta,
                "accountant": self.accountant.kind, "covers": covers,
                "noise_multipliers": dict(self.sigmas), "sample_rates": dict(self.rates),
                "feature_clip": self.clip, "grad_clip": self.grad_clip,
                "distributed_noise": self.distributed, "releases": self.accountant.releases,
                "statement": statement}


def release_plans(cfg, exp) -> list[ReleasePlan]:
    """The releases this configuration will make, for the accountant's plan."""
    calibrator = cfg.calibrator.partition(":")[0]
    plans = []
    if calibrator == "ccvr":
        plans.append(ReleasePlan(CCVR_RELEASE, 1.0, 1))
    elif calibrator == "creff":
        q = min(1.0, max(1, round(cfg.participation * cfg.clients)) / cfg.clients)
        plans.append(ReleasePlan(CREFF_RELEASE, q, cfg.rounds))
    elif calibrator == "oracle":
        raise UsageError("the oracle re-trains on raw features of every client: it is an upper "
                         "bound, not a protocol, and cannot be combined with DP")
    return plans


def plan_with_dpsgd(cfg, exp, uploads: list[ReleasePlan], delta: float
                    ) -> tuple[list[ReleasePlan], list[float]]:
    """Plans and noise multipliers with DP-SGD: every client has its own (q, steps); plan for
    each and keep the one that needs the most noise, so that every client fits the budget."""
    from privfedcal.privacy.dpsgd_local import client_rates

    share = cfg.dp_train_share if uploads else None  # alone, DP-SGD gets the whole budget
    best: tuple[list[ReleasePlan], list[float]] | None = None
    for q, steps in client_rates(cfg, exp):
        plans = [*uploads, ReleasePlan(DPSGD_RELEASE, q, steps * cfg.rounds, share=share)]
        sigmas = plan_noise(cfg.dp_eps, delta, plans, cfg.accountant)
        if best is None or sigmas[-1] > best[1][-1]:
            best = (plans, sigmas)
    assert best is not None
    return best


def build_protected_uplink(cfg, exp) -> Uplink:
    from privfedcal.privacy.secagg_stage import SecAggStage

    if cfg.hide_counts and not (cfg.secagg or cfg.dp_enabled):
        raise UsageError("--hide-counts needs --secagg (counts travel encrypted) or --dp-eps "
                         "(counts are noised): in the clear every count is visible")
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
        n_total = int(sum(int(p.numel()) for p in exp.parts))
        delta = cfg.dp_delta if cfg.dp_delta is not None else min(1e-5, 1.0 / (10 * n_total))
        plans = release_plans(cfg, exp)
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
                              for p in plans])
        if cfg.dp_train:
            from privfedcal.privacy.dpsgd_local import verify_clients

            dp.steps[DPSGD_RELEASE] = plans[-1].steps // cfg.rounds
            uploads = [(z, p.sample_rate, p.steps) for p, z in zip(plans, sigmas, strict=True)
                       if p.name != DPSGD_RELEASE]
            verify_clients(cfg, exp, uploads, dp.sigmas[DPSGD_RELEASE], delta, cfg.dp_eps)
    if cfg.dp_train:
        import dataclasses

        from privfedcal.privacy.dpsgd_local import DPSGDSpec

        exp.spec = dataclasses.replace(exp.spec, dp_sgd=DPSGDSpec(
            dp.sigmas[DPSGD_RELEASE], cfg.dp_grad_clip or DP_DEFAULT_GRAD_CLIP))
    secagg = SecAggStage.for_run(cfg, exp, clip=clip, grad_clip=grad_clip, dp=dp) \
        if cfg.secagg else None
    hints = []
    weighting = cfg.calibration_params.get("creff_weighting") or cfg.calibration_params.get(
        "weighting", "client")
    if dp_on and cfg.calibrator == "creff" and weighting != "sample":
        hints.append("CReFF's client weighting uploads per-class means, whose signal does not "
                     "grow with the data: under DP, --creff-weighting sample is far more "
                     "accurate (docs/results.md)")
    return Uplink(bound=bound, dp=dp, secagg=secagg, seed=cfg.seed, hide_counts=cfg.hide_counts,
                  hints=hints)
