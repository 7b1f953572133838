"""The DP noise of the uploads and the run's accounting (one accountant per client).

``DPAccounting`` holds the planned noise multipliers, sample rates and clip bounds of every
release and charges each release to the accountants of the clients that took part. It is
not a stage: the noise stage of the uplink (privacy/stages.py ``NoiseStage``) draws its
noise through it. It knows nothing of methods: the planning layer
(privfedcal/privacy/planner.py) builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import PrivacyAccountant
from privfedcal.privacy.client_ledger import ClientLedger
from privfedcal.privacy.dp import gaussian_mechanism, noise_stds
from privfedcal.privacy.releases import DPSGD_RELEASE, USER_DP_RELEASE

#: what every epsilon the run reports assumes (summary.json, docs/privacy.md)
ASSUMPTIONS = [
    "sample-level DP: neighbouring datasets differ in one training example of one client",
    "per-client accounting over the releases the client took part in, q = 1 (no "
    "amplification by client sampling: the server chooses and sees the participants)",
    "DP-SGD's Poisson batches are drawn on the client from OS entropy: amplification by "
    "that subsampling is used (the server never sees the batches)",
    "noise drawn from OS entropy (no --insecure-seeded-noise)",
    "every client keeps its own ledger and refuses a release past the count planned from "
    "the public config, so a server that selects it more often gets a refusal",
    "with --secagg and distributed noise: the key holder does not collude with the server",
]
#: the adjacency of a run whose only release is DP-FedAvg's (--dp-updates alone)
USER_ADJACENCY = ("user-level DP: neighbouring federations differ in one client's whole "
                  "data, present or absent")
#: summary.json lists every client's epsilon up to this many clients; beyond, only how many
#: clients spent each distinct epsilon (10,000 equal entries took 324 KiB)
LISTED_CLIENTS = 1000


@dataclass
class DPAccounting:
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
    #: each client's own ledger (privacy/client_ledger.py), where the simulator plays the
    #: clients; a Flower node keeps its own in its Context.state (flower/node_ledger.py)
    ledgers: dict[int, ClientLedger] = field(default_factory=dict)

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

    def client_epsilons(self) -> dict[int, float]:
        """Each client's epsilon spent, computed once per distinct history of releases
        (thousands of clients share a few)."""
        known: dict[str, float] = {}
        out = {}
        for c, acc in sorted(self.per_client.items()):
            if c < 0:
                continue
            history = repr(acc.state_dict()["history"])
            if history not in known:
                known[history] = acc.epsilon()
            out[c] = known[history]
        return out

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

    def ledger(self, client: int) -> ClientLedger:
        """Client ``client``'s own ledger, its limits from this plan (the run config)."""
        if client not in self.ledgers:
            self.ledgers[client] = ClientLedger.planned(self)
        return self.ledgers[client]

    def admit(self, label: str, clients) -> None:
        """The clients' side: each of ``clients`` counts a release of ``label`` in its own
        ledger, or refuses it (``BudgetRefused``, nothing counted for anyone) if it would
        take that client past the planned count."""
        ledgers = [self.ledger(int(c)) for c in clients]
        for ledger in ledgers:
            ledger.check(label)
        for ledger in ledgers:
            ledger.record(label)

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
        """From the release's declaration (its calibrator's ``ReleaseSpec``, the only place
        a payload's sensitivities are written); an undeclared release is refused rather than
        noised with a guessed sensitivity."""
        spec = self.specs.get(label) if label is not None else None
        if spec is None:
            raise UsageError(f"release {label!r} has no declaration (ReleaseSpec) giving its "
                             "payload's sensitivities; refusing to release it")
        return spec.sensitivities(keys, clip=self.clip, grad_clip=self.grad_clip)

    def budget(self, label: str) -> dict[str, float] | None:
        """How the release's declaration splits its noise budget between its keys (None:
        equally; ``ReleaseSpec.noise_share``)."""
        spec = self.specs.get(label)
        return spec.budget() if spec is not None else None

    def symmetric(self, label: str) -> frozenset[str]:
        """The release's keys that hold symmetric matrices (``ReleaseSpec.symmetric``):
        their noise is symmetrised (none for a release without a declaration)."""
        spec = self.specs.get(label)
        return spec.symmetric if spec is not None else frozenset()

    def noise(self, payload: dict[str, Tensor], label: str, generator, share: float) -> dict:
        return gaussian_mechanism(payload, self.sensitivities(payload, label), self._noise_multiplier(label),
                                  generator, share=share, budget=self.budget(label))

    def stds(self, keys, label: str) -> dict[str, float]:
        return noise_stds(self.sensitivities(keys, label), self._noise_multiplier(label),
                          budget=self.budget(label))

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(),
                "clients": {str(c): a.state_dict() for c, a in self.per_client.items()},
                "ledgers": {str(c): g.state_dict() for c, g in self.ledgers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.per_client = {}
        for c, st in state.get("clients", {}).items():
            self._acc(int(c)).load_state_dict(st)
        self.ledgers = {}
        for c, st in state.get("ledgers", {}).items():
            self.ledger(int(c)).load_state_dict(st)

    def summary(self) -> dict[str, Any]:
        user = USER_DP_RELEASE in self.sigmas  # --dp-updates (privacy/user_dp.py)
        uploads = any(label not in (DPSGD_RELEASE, USER_DP_RELEASE) for label in self.sigmas)
        covers = " and ".join(
            [w for w, on in (("calibration uploads", uploads),
                             ("model updates (DP-SGD)", self.covers_updates),
                             ("model updates (user-level DP-FedAvg)", user)) if on])
        if not (self.covers_updates or user):
            covers += " only"
        spent = self.epsilon()
        # DP-FedAvg alone bounds one client's whole data; with a sample-level release (a
        # calibration upload, DP-SGD) in the same accountant the composed guarantee is per
        # example (a user-level release is also a sample-level one)
        user_only = user and not uploads and not self.covers_updates
        level = ("at user level (one client's whole data)" if user_only
                 else "per example, sample level")
        statement = (f"({spent:.3f}, {self.delta:.2g})-DP {level}, for the "
                     f"worst-off client, spent of epsilon {self.target:g} "
                     f"({self.accountant.kind}); covers {covers}; no amplification by client "
                     "sampling (the server chooses and sees the participants); assumes the "
                     "noise stays secret (drawn from OS entropy) and, with --secagg, a key "
                     "holder that does not collude with the server")
        if not (self.covers_updates or user):
            statement += ". Model updates are NOT differentially private (no --dp-train)."
        return {"epsilon_spent": spent, "epsilon_target": self.target, "delta": self.delta,
                "accountant": self.accountant.kind, "covers": covers,
                "noise_multipliers": dict(self.sigmas), "sample_rates": dict(self.rates),
                "feature_clip": self.clip, "grad_clip": self.grad_clip,
                "distributed_noise": self.distributed, "releases": self.accountant.releases,
                **self._client_epsilon_fields(),
                "client_release_limits": ClientLedger.planned(self).limits,
                "assumptions": self.assumptions(user_only), "statement": statement}

    def _client_epsilon_fields(self) -> dict[str, Any]:
        """``epsilon_clients``: how many clients spent each distinct epsilon, largest first;
        ``per_client_epsilon``: every client's, listed up to ``LISTED_CLIENTS`` clients."""
        eps = self.client_epsilons()
        counts: dict[float, int] = {}
        for e in eps.values():
            counts[e] = counts.get(e, 0) + 1
        out: dict[str, Any] = {"epsilon_clients": {repr(e): counts[e]
                                                   for e in sorted(counts, reverse=True)}}
        if len(eps) <= LISTED_CLIENTS:
            out["per_client_epsilon"] = {str(c): e for c, e in eps.items()}
        return out

    def assumptions(self, user_only: bool) -> list[str]:
        """``ASSUMPTIONS`` for this run: the adjacency it is stated for, and DP-SGD's
        batches only where DP-SGD runs."""
        out = [USER_ADJACENCY if user_only else ASSUMPTIONS[0], *ASSUMPTIONS[1:]]
        return [a for a in out if self.covers_updates or not a.startswith("DP-SGD's")]
