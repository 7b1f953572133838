"""``attack``: the Python API's attacks on what the server saw in a run, as ``privfedcal
attack`` runs them (records returned, nothing written); ``privfedcal.api`` re-exports it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from privfedcal.api.arguments import options_of, python_surface, register_check
from privfedcal.api.run import Run, check_progress
from privfedcal.errors import UsageError

if TYPE_CHECKING:
    from privfedcal.attacks.reconstruction.progress import Progress
    from privfedcal.results import AttackRecord

__all__ = ["attack", "attack_kinds"]

register_check("bool | Callable[[Progress], None]", check_progress)  # an attack's progress


def attack_kinds() -> tuple[str, ...]:
    """The kinds ``attack`` takes: every registered attack (``attacks/release_attacks.py``:
    ``stats`` and ``gradients`` on the calibrators' releases, ``updates`` on the model
    updates, ``disaggregate`` and any other on the run as a whole), and ``classes``."""
    from privfedcal.attacks.release_attacks import registered

    return (*(a.name for a in registered()), "classes")


@python_surface
def attack(run: Run | str | Path, kind: str, *, steps: int | None = None, restarts: int = 4,
           clients: Iterable[int] | None = None, classes: Iterable[int] | None = None,
           seed: int = 0, device: str = "cpu",
           progress: bool | Callable[[Progress], None] | None = None,
           **options: Any) -> list[AttackRecord]:
    """Attack what the server observed in ``run`` and return one record per attacked
    target (the rows of ``attack.json``; scored against the truth when the experimenter's
    side of the run folder is there, unscored on a server view alone).

    ``kind``: a registered attack (``attack_kinds()``): ``stats`` (invert CCVR
    statistics), ``gradients`` (invert CReFF class gradients), ``updates`` (invert model
    updates), ``disaggregate`` (difference secure sums across rounds), or ``classes``
    (infer each client's class set). ``steps`` caps each inversion (default: run to
    convergence, up to ``DEFAULT_MAX_STEPS``); ``steps``, ``restarts`` and ``seed`` apply
    to the kinds whose options have them. Other ``options`` are fields of the attack's
    options type (``ReleaseAttack.options``: ``privfedcal attack``'s flags by their keyword
    names, ``raw_samples=0``, ``round=2``); an unknown one is a ``UsageError``.
    ``progress`` receives a ``privfedcal.attacks.reconstruction.progress.Progress`` as the
    inversions run (``steps`` of ``total`` optimisation steps, ``targets`` of ``of``,
    ``eta`` in seconds), as ``privfedcal attack`` shows it, in place of the bar over
    optimisation steps that is drawn by default when interactive (``progress=False``: none;
    as ``train``'s). The ``privfedcal`` logger gets the attack's start and end (INFO) and
    each finished target (DEBUG). Nothing is written: ``privfedcal attack`` writes the
    files."""
    from privfedcal.api.log import AttackWatch
    from privfedcal.attacks.reconstruction.feature_inversion import DEFAULT_MAX_STEPS
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions
    from privfedcal.attacks.release_attacks import release_attack
    from privfedcal.attacks.view import load_run as load_view

    kinds = attack_kinds()
    if kind not in kinds:
        raise UsageError(f"attack kind must be one of {', '.join(kinds)}, got {kind!r}")
    kind_options = ClassesOptions if kind == "classes" else release_attack(kind).options
    fields = {f.name for f in dataclasses.fields(kind_options)}
    base = {"steps": DEFAULT_MAX_STEPS if steps is None else steps, "restarts": restarts,
            "seed": seed}  # the options type checks them
    path = run.path if isinstance(run, Run) else Path(run)
    options = options_of(kind_options, options, "attack option(s)",
                         taken=("steps", "restarts", "seed", "progress"))
    opts = kind_options(**{k: v for k, v in base.items() if k in fields}, **options)
    view = load_view(path, device=device)
    with AttackWatch(progress, f"attack {kind}", str(path)) as watch:
        records = _attack_records(view, kind, opts, clients, classes, watch)
        watch.finished(len(records))
    return records


def _attack_records(view: Any, kind: str, opts: Any, clients: Iterable[int] | None,
                    classes: Iterable[int] | None,
                    on_progress: Callable[[Progress], None]) -> list[AttackRecord]:
    """The records of ``attack``'s ``kind`` on ``view`` (a loaded server view)."""
    from privfedcal.api.attack_jobs import joint_plan
    from privfedcal.attacks.reconstruction.runner import execute
    from privfedcal.attacks.reconstruction.uploads import infer_class_sets
    from privfedcal.attacks.release_attacks import release_attack

    if kind == "classes":
        records, _ = infer_class_sets(view, opts)
        return cast("list[AttackRecord]", list(records))
    attack = release_attack(kind)
    if attack.plan is None and attack.run is not None:  # on the run as a whole: at once
        records, _ = attack.run(view, opts)
        return cast("list[AttackRecord]", list(records))
    ids = None if clients is None else list(clients)
    cls = None if classes is None else list(classes)
    if attack.plan is None:
        raise UsageError(f"attack {kind!r} has neither a planner nor a run")
    plan = joint_plan([attack], {kind: opts}, view, ids, cls)  # refuses an empty plan
    done = execute(plan, lambda job: None, on_progress=on_progress)
    # typed by their writers (tests/package/test_results.py checks them against the types)
    return cast("list[AttackRecord]", [r.record for r in done])
