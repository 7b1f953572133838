"""A run's protection as a value: what the planner decided, frozen.

``ProtectionInputs`` is what the planner (privfedcal/privacy/planner.py ``plan_protection``)
reads: the run's ``PrivacyOptions`` (privfedcal/settings/floors.py) and the public facts the plan
depends on besides them. ``ProtectionPlan`` is what the planner, a pure function of those
inputs, decided: the per-sample bounds, the DP noise of every release (``NoisePlan``), the
CKKS set-up of the calibration uploads and of the model updates (``CKKSPlan``), DP-SGD's
local schedule, DP-FedAvg's clip, and each registered stage's own set-up in client order
(privacy/stage_registry.py). Every part is frozen: the
plan is computed once from public settings, the same on the simulator, on every Flower node
and on the server, and nothing in it changes while the run goes on.

privacy/executor.py builds the live objects from it (``execute_plan``). The live objects
change (accountants record, ledgers count); the plan does not, so the same plan executed
again starts a fresh budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from privfedcal.privacy.releases import ReleaseSpec

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting
    from privfedcal.privacy.dpsgd_local import DPSGDSpec
    from privfedcal.settings.floors import PrivacyOptions


@dataclass(frozen=True)
class ReleaseSchedule:
    """One release a calibrator declares and the rounds it makes it in (per-round releases;
    a release made once, after training, lists none)."""

    spec: ReleaseSpec
    rounds: tuple[int, ...] = ()


@dataclass(frozen=True)
class PresetNoise:
    """Noise planned beside the planner for the same budget (the Flower plugin's private
    clip search, flower/plugin/clip.py): the multipliers of the run's own releases, planned
    jointly with ``extra`` releases made before them (label, noise multiplier, sample rate,
    steps), all for the run's ``target`` epsilon and ``delta``."""

    target: float
    delta: float
    sigmas: Mapping[str, float]
    extra: tuple[tuple[str, float, float, int], ...] = ()


@dataclass(frozen=True)
class ProtectionInputs:
    """What the planner reads: the run's privacy options, the federation's public number of
    training examples N, the releases its calibrator declares and when, whether that
    calibrator can be protected at all, its advice for the run's notes, and noise planned
    beside the planner (``preset``; None: the planner plans all of it). Gathered once from
    the run's settings (privfedcal/privacy/planner.py ``protection_inputs``)."""

    privacy: PrivacyOptions
    examples: int | None = None
    releases: tuple[ReleaseSchedule, ...] = ()
    protectable: bool = True
    hints: tuple[str, ...] = ()
    preset: PresetNoise | None = None

    @property
    def stages(self) -> tuple[str, ...]:
        """The opt-in stages the run names (``--stages``)."""
        return self.privacy.stage_names

    @property
    def protected(self) -> bool:
        """Whether a built-in protection guards the uplink (otherwise: in the clear, no
        bound, unless an opt-in stage is named)."""
        return self.privacy.protected


@dataclass(frozen=True)
class NoisePlan:
    """The DP noise of a run: per release label its noise multiplier, sample rate and steps
    per release, the planned groups the accountant was calibrated on, the participants the
    distributed noise is shared between, and the releases' declarations (sensitivities)."""

    target: float
    delta: float
    accountant: str  # rdp | prv
    sigmas: Mapping[str, float]
    rates: Mapping[str, float]
    clip: float
    grad_clip: float
    distributed: bool  # --secagg: every client adds a share, the key holder tops up
    covers_updates: bool  # --dp-train: the model updates are DP too
    planned: tuple[Mapping[str, Any], ...] = ()  # {"name", "sample_rate", "steps"}
    steps: Mapping[str, int] = field(default_factory=dict)  # steps of one release
    planned_clients: Mapping[str, int] = field(default_factory=dict)
    specs: Mapping[str, ReleaseSpec] = field(default_factory=dict)

    def live(self) -> DPAccounting:
        """A fresh ``DPAccounting`` (empty accountants and ledgers) for this plan."""
        from privfedcal.privacy.accounting import PrivacyAccountant
        from privfedcal.privacy.dp_accounting import DPAccounting

        return DPAccounting(target=self.target, delta=self.delta,
                       accountant=PrivacyAccountant(self.accountant, self.delta),
                       sigmas=dict(self.sigmas), rates=dict(self.rates), clip=self.clip,
                       grad_clip=self.grad_clip, distributed=self.distributed,
                       covers_updates=self.covers_updates,
                       planned=[dict(p) for p in self.planned], steps=dict(self.steps),
                       planned_clients=dict(self.planned_clients), specs=dict(self.specs))


@dataclass(frozen=True)
class CKKSPlan:
    """A CKKS-summed uplink: the largest |aggregate entry| per payload key before noise
    (``default_bound`` for keys not listed: the model updates' parameters), the clients, the
    fewest uploads in a sum, the run's cohorts, the symmetric keys of each release, and the
    clients whose own values the key holder knows (``cohorts.observers_own``)."""

    bounds: Mapping[str, float]
    clients: int
    min_clients: int
    hide_counts: bool = False
    default_bound: float | None = None
    cohorts: tuple[tuple[int, ...], ...] | None = None
    symmetric: Mapping[str, frozenset[str]] = field(default_factory=dict)
    known: tuple[int, ...] = ()


@dataclass(frozen=True)
class UserDPPlan:
    """DP-FedAvg of the model updates (``--dp-updates``, privacy/user_dp.py): the clip S,
    the public denominator, where the noise is added, the target quantile of an adaptive
    clip (None: fixed)."""

    clip: float
    denominator: int
    distributed: bool
    seed: int
    seeded: bool
    adaptive_quantile: float | None = None


@dataclass(frozen=True)
class ProtectionPlan:
    """Everything the planner decided for a run (``protected`` False: the plain uplink, in
    the clear, no bound). ``stages``: (registered name, its set-up) in client order."""

    inputs: ProtectionInputs
    protected: bool = False
    clips: Mapping[str, float] = field(default_factory=dict)  # row kind -> L2 bound
    noise: NoisePlan | None = None
    ckks: CKKSPlan | None = None
    updates: CKKSPlan | None = None  # --secagg-updates: the model updates' own wire
    dp_sgd: DPSGDSpec | None = None
    user_dp: UserDPPlan | None = None
    hints: tuple[str, ...] = ()
    stages: tuple[tuple[str, Any], ...] = ()

    def setup_of(self, name: str) -> Any:
        """The set-up of stage ``name`` in this plan (None: the run does not use it)."""
        return dict(self.stages).get(name)
