"""The registry of uplink stages: each stage's name, its place, and how a plan sets it up.

``STAGES`` (a ``registry.Registry``, the package's one idiom) maps a stage's name to its
``StageEntry``: a pure ``setup`` that reads the run's
``ProtectionPlan`` (privacy/plan.py) and returns the stage's own part of the plan (a frozen
value; None where the run does not use the stage), a ``build`` that turns that set-up into
the live stage, and its place among the other stages by name. A stage protects either the
calibration uploads (a ``Stage``, privacy/stages.py) or the model updates (``updates=True``:
an ``UpdateStage``, privacy/update_stage.py). Exactly one wire (``wire=True``) of the
uploads is planned per run, and at most one of the updates; each comes last. The
built-in entries are written out in ``STAGES``' table; a stage in its own file calls
``register_stage`` there
(tests/extensions/toy_stage.py does), and a stage marked ``opt_in`` runs only where the
run names it (the ``stages`` privacy option, ``--stages``).

Order is declared, never numbered: ``client_order`` sorts the registered stages so that
each comes after the stages its entry names in ``after`` and before those in ``before`` (in
registration order where the declarations leave a choice), wires last; a name that is not
registered, or a cycle, is refused. ``plan_stages`` asks every entry for its set-up, in that
order, and puts them in the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from privfedcal.errors import UsageError
from privfedcal.registry import Registry
from privfedcal.settings.messages import SettingError

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting
    from privfedcal.privacy.plan import ProtectionPlan
    from privfedcal.privacy.stages import Stage
    from privfedcal.privacy.update_stage import UpdateStage


@dataclass
class Shared:
    """The live objects several stages of one uplink share: the run's noise plan and
    per-client accountants (None without DP), built once by privacy/executor.py."""

    dp: DPAccounting | None = None


@dataclass(frozen=True)
class StageEntry:
    """One registered stage: ``setup(plan)`` is pure (same plan, same set-up) and returns the
    stage's part of the plan or None; ``build(setup, shared)`` makes the live stage, a
    ``Stage`` of the uploads or (``updates``) an ``UpdateStage`` of the model updates."""

    name: str
    setup: Callable[[ProtectionPlan], Any]
    build: Callable[[Any, Shared], Stage | UpdateStage]
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    wire: bool = False
    opt_in: bool = False
    updates: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "before", tuple(self.before))
        if not self.name or self.name in self.after + self.before:
            raise ValueError(f"stage {self.name!r}: a name, not among its own neighbours")


# ---- the built-in stages: bound -> noise -> one wire (in the clear, or CKKS); of the model
# updates: the adaptive clip -> DP-FedAvg -> their CKKS sum, each where planned ------------
def _bound_setup(plan: ProtectionPlan) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(plan.clips.items()))  # () without a bound: the identity


def _bound_build(setup: tuple[tuple[str, float], ...], shared: Shared) -> Stage:
    from privfedcal.privacy.bound import NoBound
    from privfedcal.privacy.dp import L2Clip
    from privfedcal.privacy.stages import BoundStage

    return BoundStage(L2Clip(dict(setup)) if setup else NoBound())


def _noise_setup(plan: ProtectionPlan) -> tuple[int, bool] | None:
    """The noise stage's own settings (the noise plan itself is shared: ``Shared.dp``)."""
    if plan.noise is None:
        return None
    return plan.inputs.privacy.seed, plan.inputs.privacy.insecure_seeded_noise


def _noise_build(setup: tuple[int, bool], shared: Shared) -> Stage:
    from privfedcal.privacy.stages import NoiseStage

    assert shared.dp is not None  # planned only with a noise plan
    seed, seeded = setup
    return NoiseStage(shared.dp, seed=seed, seeded=seeded)


def _clear_build(setup: Any, shared: Shared) -> Stage:
    from privfedcal.privacy.stages import ClearWire

    return ClearWire()


def _encrypt_build(setup: Any, shared: Shared) -> Stage:
    from privfedcal.privacy.secagg_stage import CKKSSettings, EncryptStage

    return EncryptStage(CKKSSettings.from_plan(setup, dp=shared.dp))


def _user_dp_build(setup: Any, shared: Shared) -> UpdateStage:
    from privfedcal.privacy.user_dp import UserDP

    return UserDP.of(setup, shared.dp)


def _adaptive_clip_setup(plan: ProtectionPlan) -> float | None:
    """The adaptive clip's target quantile, from the user-DP plan (None: a fixed clip)."""
    return None if plan.user_dp is None else plan.user_dp.adaptive_quantile


def _adaptive_clip_build(setup: float, shared: Shared) -> UpdateStage:
    from privfedcal.privacy.adaptive_clip import AdaptiveClip

    return AdaptiveClip(setup)


def _secagg_updates_build(setup: Any, shared: Shared) -> UpdateStage:
    from privfedcal.privacy.secagg_updates import SecureUpdates

    return SecureUpdates.of(setup)


#: every stage by name: the built-in entries, then extensions in the order their files
#: register them (``register_stage``)
STAGES: Registry[StageEntry] = Registry("stage", built_in={
    "bound": StageEntry("bound", _bound_setup, _bound_build),
    "noise": StageEntry("noise", _noise_setup, _noise_build, after=("bound",)),
    "clear": StageEntry("clear", lambda plan: () if plan.ckks is None else None, _clear_build,
                        wire=True),
    "encrypt": StageEntry("encrypt", lambda plan: plan.ckks, _encrypt_build, wire=True),
    "dp-fedavg": StageEntry("dp-fedavg", lambda plan: plan.user_dp, _user_dp_build,
                            updates=True),
    "adaptive-clip": StageEntry("adaptive-clip", _adaptive_clip_setup, _adaptive_clip_build,
                                before=("dp-fedavg",), updates=True),
    "secagg-updates": StageEntry("secagg-updates", lambda plan: plan.updates,
                                 _secagg_updates_build, after=("dp-fedavg",), wire=True,
                                 updates=True),
})


def register_stage(entry: StageEntry) -> StageEntry:
    """Add ``entry`` to ``STAGES`` under its name. A taken name is refused, unless the entry
    is the one registered (the same file imported again, under another module name: the
    newest stands)."""
    if entry.name in STAGES:
        held = get_stage(entry.name)
        if held is not entry and _source(held) == _source(entry):
            STAGES.unregister(entry.name)
    return STAGES.register(entry.name)(entry)


def _source(entry: StageEntry) -> tuple:
    """Where an entry's functions are written (file and qualified name)."""
    return tuple((getattr(getattr(f, "__code__", None), "co_filename", None),
                  getattr(f, "__qualname__", None)) for f in (entry.setup, entry.build))


def get_stage(name: str) -> StageEntry:
    """The entry registered as ``name``; an unknown name lists the registered ones."""
    return STAGES.get(name)


def opt_in_stages() -> list[str]:
    """The stages a run switches on by naming them (``--stages``)."""
    return [name for name, e in STAGES.items() if e.opt_in]


def client_order(names: Iterable[str] | None = None) -> list[str]:
    """``names`` (default: every registered stage) in client order: each after the stages
    its entry names in ``after`` and before those in ``before``, otherwise in registration
    order; wires last."""
    chosen = list(STAGES) if names is None else [get_stage(n).name for n in names]
    preds: dict[str, set[str]] = {name: set(e.after) for name, e in STAGES.items()}
    for name, e in STAGES.items():
        for other in e.after + e.before:
            if other not in STAGES:
                raise UsageError(f"stage {name!r} is placed next to {other!r}, which is not "
                                 f"registered; registered stages: {', '.join(STAGES)}")
        for later in e.before:
            preds[later].add(name)
    done: list[str] = []
    todo = list(STAGES)  # the whole registry: an order between two chosen stages may pass
    while todo:          # through one the run does not use
        ready = [n for n in todo if preds[n] <= set(done)]
        if not ready:
            raise UsageError(f"the stages {todo} come after each other in a cycle")
        done.append(ready[0])
        todo.remove(ready[0])
    rank = {n: (get_stage(n).wire, i) for i, n in enumerate(done)}
    return sorted(chosen, key=rank.__getitem__)


def plan_stages(plan: ProtectionPlan) -> ProtectionPlan:
    """``plan`` with every registered stage's set-up (``StageEntry.setup``) in client order:
    the stages it switches on, opt-in ones only where the options name them. Exactly one
    wire of the uploads, at most one of the updates."""
    named = set(plan.inputs.stages)
    unknown = named - set(opt_in_stages())
    if unknown:
        raise SettingError("unknown stage(s) {unknown} in {stages}; stages a run can name: "
                           "{known}", unknown=", ".join(sorted(unknown)),
                           known=", ".join(opt_in_stages()) or "none registered")
    chosen = []
    for name in client_order():
        entry = get_stage(name)
        if entry.opt_in and name not in named:
            continue
        setup = entry.setup(plan)
        if setup is not None:
            chosen.append((name, setup))
    wires = [n for n, _ in chosen if get_stage(n).wire and not get_stage(n).updates]
    update_wires = [n for n, _ in chosen if get_stage(n).wire and get_stage(n).updates]
    if len(wires) != 1 or len(update_wires) > 1:
        raise RuntimeError(f"a run's stages must end in exactly one wire, and the model "
                           f"updates' in at most one; planned {[n for n, _ in chosen]}")
    return dataclasses.replace(plan, stages=tuple(chosen))
