"""Which attack targets which release: attacks name the release labels they target.

A calibrator declares each of its releases once (``privacy/releases.py`` ``ReleaseSpec``:
label, payload task, sensitivities). An attack is a ``ReleaseAttack`` subclass in its own
file that names the labels of the releases it targets (``labels``) and holds everything
else: the planner ``attack invert --<name>`` and the audit run, its options type (the
flags), its section of the run report, and what the privacy audit (``audit dp``) needs to
build the release's channel. The runner finds the attacks of a release by its label
(``attacks_on``), so a second attack on a release is one more file and touches neither the
calibrator nor the first attack. The attacks privfedcal ships are written out in
``RELEASE_ATTACKS``' table (``registry.py``'s idiom: each module's ``ATTACK``, imported on
first lookup); any other module registers its attack with ``register`` when imported. The
code that drives attacks (CLI, ``privfedcal.attack``, ``audit``, ``audit dp``, the report) looks
releases and attacks up here and names no release itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from privfedcal.attacks.attack_options import NoOptions
from privfedcal.errors import UsageError
from privfedcal.registry import Registry


@dataclass(frozen=True)
class ReportTable:
    """An attack's section of the run report (``report/attack_sections.py`` renders it): a table
    of its records, which columns are numbers, and plain-text paragraphs after it."""

    columns: tuple[str, ...]
    rows: list[list[Any]]
    numeric: tuple[bool, ...] = ()
    notes: tuple[str, ...] = ()
    table_id: str | None = None


class ReleaseAttack:
    """What ``attacks/`` does with the releases of some labels. A subclass sets ``name``
    and ``labels`` and defines the hooks it has (a hook it lacks stays None).

    ``plan(view, opts, clients, classes)`` builds the inversion jobs (``runner.Plan``) from
    a run's transcript. For the privacy audit: ``task(cfg, exp, calibrator)`` is the
    release's client task with the run's options, ``clip`` what that task clips (the
    bound stage's ``bound_for`` kind: the canary is sized by it), ``keep(key, c)`` the
    index of ``payload[key]`` a canary feature on axis 0 of class ``c`` moves (the audit
    keeps only that), and ``canary_keys`` the payload keys in which a canary on axis j of
    class c moves coordinates no other canary moves (the one-run audit scores those).

    ``options`` is the attack's options type (a frozen dataclass of ``attack_options.attack_option``
    fields: its CLI flags and API keywords), ``summary`` one line on what it does (its flag's
    or command's help). ``joins`` names the attacks it may run beside in one ``attack
    invert`` (``updates`` joins ``gradients``); the others run alone.

    ``targets`` are the ``target`` names of the records its plans write, in the order the
    reports list them (``target_order``). ``audit_params`` are the calibration options the
    privacy audit (``audit``) trains its runs with: the calibrator's server-side work cut
    to what the attack needs (the attack reads only the uploads).

    An attack on the run as a whole rather than on one release (``disaggregate_attack.py``:
    every secure sum of the run together) targets no label, has no ``plan`` and defines
    ``run(view, opts)`` instead, returning its records and notes; ``audit_columns(records)``
    gives its cells of the audit's row; ``console(records, title)`` the table and lines
    ``attack <name>`` prints, ``figure`` the PNG it writes beside attack.json (file name,
    ``plot(records, path)``). ``run_attacks`` lists them. ``report(records)`` gives the
    attack's section of the run report (``ReportTable``), on the records of its
    ``targets``."""

    name: ClassVar[str] = ""
    #: the labels of the releases it targets (``ReleaseSpec.label``)
    labels: ClassVar[tuple[str, ...]] = ()
    clip: ClassVar[str] = "feature"
    canary_keys: ClassVar[tuple[str, ...]] = ()
    targets: ClassVar[tuple[str, ...]] = ()
    audit_params: ClassVar[Mapping[str, Any]] = {}
    options: ClassVar[type] = NoOptions
    summary: ClassVar[str] = ""
    joins: ClassVar[tuple[str, ...]] = ()
    figure: ClassVar[tuple[str, Callable[..., Any]] | None] = None
    # the hooks: a subclass defines those it has as methods
    plan: Callable[..., Any] | None = None
    task: Callable[..., Any] | None = None
    keep: Callable[[str, int], Any] | None = None
    run: Callable[..., Any] | None = None
    audit_columns: Callable[..., Mapping[str, Any]] | None = None
    report: Callable[[list[dict[str, Any]]], ReportTable | None] | None = None
    console: Callable[..., tuple[Any, list[str]]] | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.name.isidentifier():
            raise ValueError(f"{cls.__qualname__}: an attack's name is a plain name (its "
                             f"flag --<name>), got {cls.name!r}")
        if cls.plan is None and cls.run is None:
            raise ValueError(f"attack {cls.name!r}: define plan (on its releases) or run "
                             "(on the run as a whole)")
        if isinstance(cls.labels, str):
            raise ValueError(f"attack {cls.name!r}: labels is a tuple of release labels")

    def __repr__(self) -> str:
        return f"<attack {self.name} on {', '.join(self.labels) or 'the whole run'}>"


#: every attack by name: the ones privfedcal ships (each module's ``ATTACK``, imported on
#: first lookup so that importing this registry stays cheap), in the order the CLI offers
#: them, then extensions in the order they registered (``register``)
RELEASE_ATTACKS: Registry[ReleaseAttack] = Registry("release attack", built_in={
    "stats": "privfedcal.attacks.reconstruction.stats_attack:ATTACK",
    "gradients": "privfedcal.attacks.reconstruction.gradients_attack:ATTACK",
    "updates": "privfedcal.attacks.reconstruction.updates_attack:ATTACK",
    "disaggregate": "privfedcal.attacks.reconstruction.disaggregate_attack:ATTACK",
})


def register(attack: ReleaseAttack) -> ReleaseAttack:
    """Add ``attack`` (an instance of a ``ReleaseAttack`` subclass) under its name; a taken
    name is refused."""
    return RELEASE_ATTACKS.register(attack.name)(attack)


def unregister(name: str) -> ReleaseAttack:
    """Take an extension's attack out again (a test's); a built-in one stays."""
    return RELEASE_ATTACKS.unregister(name)


def registered() -> list[ReleaseAttack]:
    """Every registered attack: the built-in ones in their table's order, then the others
    in the order they registered."""
    return [attack for _, attack in RELEASE_ATTACKS.items()]


def attacks_on(label: str) -> list[ReleaseAttack]:
    """The registered attacks that target the release labelled ``label``, in registration
    order."""
    return [a for a in registered() if label in a.labels]


def plan_attacks() -> list[ReleaseAttack]:
    """The attacks with a planner (``attack invert``'s), in registration order."""
    return [a for a in registered() if a.plan is not None]


def check_combination(chosen: Sequence[ReleaseAttack], offered: Sequence[ReleaseAttack]
                      ) -> None:
    """Refuse, in one line, a choice of ``attack invert`` flags that cannot run together:
    none, or two attacks neither of which joins the other."""
    alone = " or ".join(f"--{a.name}" for a in offered if not a.joins)
    joining = ", ".join(f"--{a.name}" for a in offered if a.joins)
    usage = f"give exactly one of {alone}" + (f" (and/or {joining})" if joining else "")
    if not chosen:
        raise UsageError(usage)
    for a in chosen:
        for b in chosen:
            if a is b or a.name in b.joins or b.name in a.joins:
                continue
            joiner = a if a.joins else b if b.joins else None
            if joiner is None:
                raise UsageError(usage)
            other = b if joiner is a else a
            raise UsageError(f"--{joiner.name} goes with "
                             f"{' or '.join('--' + n for n in joiner.joins)} or alone, not "
                             f"with --{other.name}")


def calibrator_of(attack: ReleaseAttack) -> str | None:
    """The calibrator whose release ``attack`` (or an attack it joins) targets: the one a
    quick run to attack trains. None: no calibrator's release."""
    import privfedcal.calibration  # noqa: F401
    from privfedcal.federation.hooks import CALIBRATORS

    labels = {label for a in (attack, *(release_attack(n) for n in attack.joins))
              for label in a.labels}
    for calibrator in CALIBRATORS.names():
        if any(r.label in labels for r in getattr(CALIBRATORS.get(calibrator), "releases", ())):
            return calibrator
    return None


def release_attack(name: str) -> ReleaseAttack:
    """The attack registered under ``name``; an unknown name lists the registered ones."""
    return RELEASE_ATTACKS.get(name)


def declared_releases() -> list[Any]:
    """Every release the registered calibrators declare (``ReleaseSpec``), by calibrator
    name."""
    import privfedcal.calibration  # noqa: F401  (every calibrator registers itself)
    from privfedcal.federation.hooks import CALIBRATORS

    return [r for name in CALIBRATORS.names()
            for r in getattr(CALIBRATORS.get(name), "releases", ())]


def release_for(attack: str) -> Any:
    """The declaration (``ReleaseSpec``) of the first declared release the attack named
    ``attack`` targets."""
    labels = release_attack(attack).labels
    found = [r for r in declared_releases() if r.label in labels]
    if not found:
        names = sorted({a.name for r in declared_releases() for a in attacks_on(r.label)})
        raise UsageError(f"no release is attacked by {attack!r} (attacks: {', '.join(names)})")
    return found[0]


def attack_names() -> dict[str, list[str]]:
    """Release label -> the names of the registered attacks on it (the client fields
    table's "read by" column)."""
    return {r.label: [a.name for a in attacks_on(r.label)] for r in declared_releases()}


def attacked_calibrators() -> tuple[str, ...]:
    """The calibrators that make a release some registered attack targets."""
    import privfedcal.calibration  # noqa: F401
    from privfedcal.federation.hooks import CALIBRATORS

    return tuple(n for n in CALIBRATORS.names()
                 if any(attacks_on(r.label)
                        for r in getattr(CALIBRATORS.get(n), "releases", ())))


def attacks_of(calibrator: Any) -> list[tuple[Any, ReleaseAttack]]:
    """``(release, attack)`` for each release of ``calibrator`` (class or object) and each
    registered attack on it, in declaration order, then registration order."""
    return [(r, a) for r in getattr(calibrator, "releases", ()) for a in attacks_on(r.label)]


def target_order() -> tuple[str, ...]:
    """Every record target the registered attacks write, in report order: the attacks in
    the order of the releases they target (``declared_releases``), then any other by
    registration."""
    first = [a.name for r in declared_releases() for a in attacks_on(r.label)]
    names = list(dict.fromkeys(first)) + [a.name for a in registered() if a.name not in first]
    return tuple(dict.fromkeys(t for n in names for t in release_attack(n).targets))


def run_attacks() -> list[ReleaseAttack]:
    """The registered attacks that read a run as a whole (``ReleaseAttack.run``), in
    registration order."""
    return [a for a in registered() if a.run is not None]


def audit_params(calibrator: str) -> dict[str, Any]:
    """The calibration options the audit trains ``calibrator`` with (the ``audit_params``
    of the attacks on its releases)."""
    import privfedcal.calibration  # noqa: F401
    from privfedcal.federation.hooks import CALIBRATORS

    out: dict[str, Any] = {}
    for _, attack in attacks_of(CALIBRATORS.get(calibrator)):
        out.update(attack.audit_params)
    return out


__all__ = ["RELEASE_ATTACKS", "ReleaseAttack", "ReportTable", "attack_names",
           "attacked_calibrators", "attacks_of", "attacks_on", "audit_params",
           "calibrator_of", "check_combination", "declared_releases", "plan_attacks",
           "register", "registered", "release_attack", "release_for", "run_attacks",
           "target_order", "unregister"]
