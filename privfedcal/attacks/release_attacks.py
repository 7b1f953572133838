"""Which attack targets which release: the registry behind ``ReleaseSpec.attack``.

A calibrator declares each of its releases once (``privacy/releases.py`` ``ReleaseSpec``:
label, payload task, sensitivities, and ``attack``, the name of the attack that targets
it). The attack's own file (``attacks/reconstruction/<name>_attack.py``, listed in
``BUILT_IN``) registers a ``ReleaseAttack`` under that name: the planner ``attack invert --<name>`` and the audit
run, and what the privacy audit (``audit dp``) needs to build the release's channel. The
code that drives attacks (CLI, ``privfedcal.attack``, ``audit``, ``audit dp``) looks
releases and attacks up here and names no release itself, so a new release is its
calibrator's declaration plus one attack file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from privfedcal.errors import UsageError
from privfedcal.registry import Registry

#: the attacks privfedcal ships, by name: the module that registers each (imported on first
#: use, so that importing this registry stays cheap); any other module registers its attack
#: when it is imported
BUILT_IN = {
    "stats": "privfedcal.attacks.reconstruction.stats_attack",
    "gradients": "privfedcal.attacks.reconstruction.gradients_attack",
    "disaggregate": "privfedcal.attacks.reconstruction.disaggregate_attack",
}


@dataclass(frozen=True)
class ReleaseAttack:
    """What ``attacks/`` does with one kind of release.

    ``plan(view, opts, clients, classes)`` builds the inversion jobs (``runner.Plan``) from
    a run's transcript. For the privacy audit: ``task(cfg, exp, calibrator)`` is the
    release's client task with the run's options, ``clip`` what that task clips (the
    bound stage's ``bound_for`` kind: the canary is sized by it), ``keep(key, c)`` the
    index of ``payload[key]`` a canary feature on axis 0 of class ``c`` moves (the audit
    keeps only that), and ``canary_keys`` the payload keys in which a canary on axis j of
    class c moves coordinates no other canary moves (the one-run audit scores those).

    ``targets`` are the ``target`` names of the records its plans write, in the order the
    reports list them (``target_order``). ``audit_params`` are the calibration options the
    privacy audit (``audit``) trains its runs with: the calibrator's server-side work cut
    to what the attack needs (the attack reads only the uploads).

    An attack on the run as a whole rather than on one release (``disaggregate_attack.py``:
    every secure sum of the run together) has no ``plan`` and gives ``run(view, opts)``
    instead, returning its records and notes; ``audit_columns(records)`` gives its cells of
    the audit's row. ``run_attacks`` lists them."""

    name: str
    plan: Callable[..., Any] | None
    task: Callable[..., Any] | None = None
    clip: str = "feature"
    keep: Callable[[str, int], Any] | None = None
    canary_keys: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    audit_params: Mapping[str, Any] = field(default_factory=dict)
    run: Callable[..., Any] | None = None
    audit_columns: Callable[..., Mapping[str, Any]] | None = None


RELEASE_ATTACKS: Registry[ReleaseAttack] = Registry("release attack")
_found = False


def register(attack: ReleaseAttack) -> ReleaseAttack:
    RELEASE_ATTACKS.register(attack.name)(attack)
    return attack


def _discover() -> None:
    """Import the modules of ``BUILT_IN`` once, so each registers itself (on first use:
    importing this module stays cheap and cannot run into a half-imported attack file)."""
    global _found
    if _found:
        return
    _found = True
    for module in BUILT_IN.values():
        importlib.import_module(module)


def release_attack(name: str) -> ReleaseAttack:
    """The attack registered under ``name`` (a ``ReleaseSpec.attack``)."""
    _discover()
    return RELEASE_ATTACKS.get(name)


def declared_releases() -> list[Any]:
    """Every release the registered calibrators declare (``ReleaseSpec``), by calibrator
    name."""
    import privfedcal.calibration  # noqa: F401  (every calibrator registers itself)
    from privfedcal.federation.hooks import CALIBRATORS

    return [r for name in CALIBRATORS.names()
            for r in getattr(CALIBRATORS.get(name), "releases", ())]


def release_for(attack: str) -> Any:
    """The declaration (``ReleaseSpec``) of the release ``attack`` targets."""
    found = [r for r in declared_releases() if r.attack == attack]
    if not found:
        names = sorted({r.attack for r in declared_releases() if r.attack})
        raise UsageError(f"no release is attacked by {attack!r} (attacks: {', '.join(names)})")
    return found[0]


def attacked_calibrators() -> tuple[str, ...]:
    """The calibrators that make a release some registered attack targets."""
    import privfedcal.calibration  # noqa: F401
    from privfedcal.federation.hooks import CALIBRATORS

    _discover()
    return tuple(n for n in CALIBRATORS.names()
                 if any(r.attack in RELEASE_ATTACKS
                        for r in getattr(CALIBRATORS.get(n), "releases", ())))


def attacks_of(calibrator: Any) -> list[tuple[Any, ReleaseAttack]]:
    """``(release, attack)`` for each release of ``calibrator`` (class or object) that a
    registered attack targets, in its declaration order."""
    _discover()
    return [(r, RELEASE_ATTACKS.get(r.attack)) for r in getattr(calibrator, "releases", ())
            if r.attack in RELEASE_ATTACKS]


def target_order() -> tuple[str, ...]:
    """Every record target the registered attacks write, in report order: the attacks in
    the order of the releases they target (``declared_releases``), then any other by name."""
    _discover()
    first = [r.attack for r in declared_releases() if r.attack in RELEASE_ATTACKS]
    names = list(dict.fromkeys(first)) + [n for n in RELEASE_ATTACKS.names() if n not in first]
    return tuple(dict.fromkeys(t for n in names for t in RELEASE_ATTACKS.get(n).targets))


def run_attacks() -> list[ReleaseAttack]:
    """The registered attacks that read a run as a whole (``ReleaseAttack.run``), by name."""
    _discover()
    return [a for n in RELEASE_ATTACKS.names() if (a := RELEASE_ATTACKS.get(n)).run is not None]


def audit_params(calibrator: str) -> dict[str, Any]:
    """The calibration options the audit trains ``calibrator`` with (the ``audit_params``
    of the attacks on its releases)."""
    import privfedcal.calibration  # noqa: F401
    from privfedcal.federation.hooks import CALIBRATORS

    out: dict[str, Any] = {}
    for _, attack in attacks_of(CALIBRATORS.get(calibrator)):
        out.update(attack.audit_params)
    return out


__all__ = ["BUILT_IN", "RELEASE_ATTACKS", "ReleaseAttack", "attacked_calibrators", "attacks_of",
           "audit_params", "declared_releases", "register", "release_attack", "release_for",
           "run_attacks", "target_order"]
