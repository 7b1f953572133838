"""The jobs of ``privfedcal attack``, as the command runs them after parsing its flags.

``invert_for_cli`` runs the chosen registered attacks as one batched plan (their inversions
batch together), resumable: an interrupted attack leaves its finished targets in a partial
``attack.json`` (``attacks/reconstruction/resume.py``) that the same call with ``resume``
completes. ``classes_for_cli`` infers every client's class set; ``whole_for_cli`` runs an
attack on the run as a whole (``disaggregate``). Without a run folder, ``invert`` and
``classes`` first train a quick run on digits with the calibrator whose release the attack
targets. Each writes ``attack.json`` and its figure into the output folder all or nothing
(earlier results kept unless ``overwrite``) and returns what the command prints. Their
messages name the command's flags; what the command shows while they run (the quick run's
rounds, a bar over the inversions' steps, its lines) is the ``Shown`` it passes.
``privfedcal.attack`` is the Python face of the same attacks (records returned, nothing
written).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from privfedcal.errors import Interrupted, UsageError
from privfedcal.report.output_folder import all_or_nothing, check_fresh

if TYPE_CHECKING:
    from privfedcal.attacks.reconstruction.progress import Progress
    from privfedcal.federation.simulator import Simulator

#: the quick run trained when no run folder is given (digits; a few seconds on a CPU)
QUICK_RUN: dict[str, Any] = dict(dataset="digits", clients=5, alpha=0.3, rounds=5,
                                 local_epochs=1, threads=1)

INVERT_FILES = ("attack.json", "reconstructions.png")
CLASSES_FILES = ("attack.json", "classes.png")


class Shown(Protocol):
    """What the command shows while an attack job runs."""

    def say(self, line: str) -> None:
        """A line for the user."""

    def train(self, sim: Simulator) -> dict[str, Any]:
        """Run the quick run's simulator to its end, showing its rounds; its summary."""

    def progress(self, kind: str) -> AbstractContextManager[Callable[[Progress], None]]:
        """While the ``kind`` attack runs: what receives its progress."""


@dataclass(frozen=True)
class AttackOutcome:
    """What an attack job wrote and what the command prints of it: the ``records`` (the
    rows of attack.json), the attacks' ``notes``, the attacked ``run`` folder, the
    ``out_dir`` and the ``files`` written there, and the ``kind`` its outputs are named by."""

    records: list[dict[str, Any]]
    notes: list[str]
    run: Path
    out_dir: Path
    files: tuple[str, ...]
    kind: str


def quick_run(calibrator: str, run_dir: Path | None, *, seed: int, device: str,
              threads: int | None, shown: Shown) -> Path:
    """Train a small run on digits calibrated by ``calibrator`` through the same code as
    ``privfedcal train``, with the calibration options its attacks declare for a quick
    attack (``ReleaseAttack.audit_params``); a finished one in ``run_dir`` is reused."""
    from privfedcal.attacks.release_attacks import audit_params
    from privfedcal.experiment import build_simulator
    from privfedcal.settings.run_config import METHOD_ALIASES, RunConfig

    method = calibrator
    if run_dir is None:
        run_dir = Path("runs") / f"quick-{method}-digits-{time.strftime('%Y%m%d-%H%M%S')}"
    if (run_dir / "summary.json").exists():
        shown.say(f"reusing the quick run in {run_dir}")
        return run_dir
    quick = {**QUICK_RUN, "threads": threads or QUICK_RUN["threads"]}
    # ccvr and creff are methods of their own (FedAvg then the calibrator)
    how: dict[str, Any] = ({"method": method} if method in METHOD_ALIASES
                           else {"method": "fedavg", "calibrate": calibrator})
    cfg = RunConfig.of(seed=seed, device=device, out=str(run_dir),
                       calibration_params=audit_params(calibrator), **how, **quick)
    summary = shown.train(build_simulator(cfg, run_dir))
    shown.say(f"no --run given: trained a quick {method} run on digits into {run_dir} "
              f"(accuracy {summary['accuracy']:.4f})")
    return run_dir


def earlier_targets(out_dir: Path, files: tuple[str, ...], settings: dict, keys: list[str],
                    *, resume: bool, overwrite: bool) -> dict | None:
    """The finished targets of a partial attack in ``out_dir`` with ``resume`` (checked
    against ``settings`` and the plan's ``keys``); None otherwise, after refusing to
    replace earlier results without ``overwrite``."""
    from privfedcal.attacks.reconstruction.resume import finished, read_partial

    partial = read_partial(out_dir) if not overwrite else None
    if resume:
        if partial is None:
            raise UsageError(f"--resume: {out_dir} holds no partial attack to finish")
        check_fresh(out_dir, (), overwrite=True)  # still writable
        return finished(partial, settings, keys)
    if partial is not None:
        raise UsageError(f"{out_dir} holds a partial attack ({len(partial.targets)} of "
                         f"{partial.planned} targets); finish it with the same command and "
                         "--resume, or pass --overwrite to start over")
    check_fresh(out_dir, files, overwrite=overwrite)  # before the attack's minutes
    return None


def keep_partial(out_dir: Path, files: tuple[str, ...], settings: dict, keys: list[str],
                 stop: Any) -> Interrupted:
    """Write the targets an interrupted attack finished (a partial attack.json, all or
    nothing) and say how to finish it."""
    from privfedcal.attacks.reconstruction.resume import PARTIAL_IMAGES, write_partial
    from privfedcal.attacks.reconstruction.scoring import save_grid

    done = len(stop.finished)
    with all_or_nothing(out_dir, (*files, PARTIAL_IMAGES)) as paths:
        write_partial(paths["attack.json"], paths[PARTIAL_IMAGES], settings, keys,
                      stop.finished)
        save_grid([stop.finished[i] for i in sorted(stop.finished)],
                  paths["reconstructions.png"], title=f"partial attack: {done} of "
                  f"{stop.of} targets")
    return Interrupted(f"wrote the {done} finished targets of {stop.of} to "
                       f"{out_dir / 'attack.json'} (partial); finish the others with the "
                       "same command and --resume")


def joint_plan(chosen: list[Any], opts: dict[str, Any], view: Any,
               client_ids: list[int] | None, class_ids: list[int] | None) -> Any:
    """The chosen attacks' jobs on ``view`` as one plan (their inversions batch together);
    refuses an empty plan with the attacks' notes."""
    from privfedcal.attacks.reconstruction.runner import Plan

    plan = Plan(attack_batch=min(o.attack_batch for o in opts.values()))
    for a in chosen:
        part = a.plan(view, opts[a.name], client_ids, class_ids)
        plan.jobs += part.jobs
        plan.notes += part.notes
        plan.shared.update(part.shared)
    if not plan.jobs:
        raise UsageError("nothing to attack" + (": " + "; ".join(plan.notes) if plan.notes else ""))
    return plan


def attacked_run(chosen: list[Any], run: Path | None, out: Path | None, *, seed: int,
                 device: str, threads: int | None, resume: bool, overwrite: bool,
                 shown: Shown) -> Path:
    """The run folder to attack: ``run``, or a quick run of the first chosen attack's
    calibrator (under ``out``/run), after checking that ``out`` holds no earlier attack."""
    from privfedcal.attacks.release_attacks import calibrator_of

    if run is None and out is not None and not resume:  # refused before the quick run
        check_fresh(out, INVERT_FILES, overwrite=overwrite)
    if run is None:
        calibrator = next(c for a in chosen if (c := calibrator_of(a)) is not None)
        run = quick_run(calibrator, out / "run" if out else None, seed=seed, device=device,
                        threads=threads, shown=shown)
    return run


def invert_for_cli(chosen: list[Any], opts: dict[str, Any], *, run: Path | None,
                   out: Path | None, clients: list[int] | None, classes: list[int] | None,
                   device: str, threads: int | None, seed: int, resume: bool, overwrite: bool,
                   shown: Shown) -> AttackOutcome:
    """``attack invert``: the ``chosen`` attacks (their ``opts`` by name) on ``run`` as one
    batched plan; attack.json and the PNG grid into ``out`` (default RUN/attack-<kind>,
    the kind of the attack that does not join the others)."""
    from privfedcal.attacks.reconstruction.resume import PARTIAL_IMAGES, job_keys
    from privfedcal.attacks.reconstruction.runner import (
        Stopped,
        execute,
        load_run,
        sigterm_interrupts,
    )
    from privfedcal.attacks.reconstruction.scoring import save_grid, write_records

    kind = next((a.name for a in chosen if not a.joins), chosen[0].name)
    run = attacked_run(chosen, run, out, seed=seed, device=device, threads=threads,
                       resume=resume, overwrite=overwrite, shown=shown)
    plan = joint_plan(chosen, opts, load_run(run, device=device), clients, classes)
    out_dir = out or Path(run) / f"attack-{kind}"
    settings = {"attack": kind, "attacks": [a.name for a in chosen],
                "run": str(Path(run).resolve()), "clients": clients, "classes": classes,
                **{k: v for o in opts.values() for k, v in dataclasses.asdict(o).items()}}
    keys = job_keys([job.description for job in plan.jobs])
    done = earlier_targets(out_dir, INVERT_FILES, settings, keys, resume=resume,
                           overwrite=overwrite)
    try:
        with shown.progress(kind) as on_progress, sigterm_interrupts():
            results = execute(plan, on_progress=on_progress, done=done)
    except Stopped as stop:
        raise keep_partial(out_dir, INVERT_FILES, settings, keys, stop) from None
    records = [r.record for r in results]
    with all_or_nothing(out_dir, INVERT_FILES) as paths:
        write_records(records, paths["attack.json"])
        save_grid(results, paths["reconstructions.png"],
                  title=f"{kind} attack on {run}: true (top) vs reconstructed (bottom)")
    (out_dir / PARTIAL_IMAGES).unlink(missing_ok=True)  # a resumed attack is whole now
    return AttackOutcome(records, plan.notes, Path(run), out_dir, INVERT_FILES, kind)


def classes_for_cli(opts: Any, *, run: Path | None, out: Path | None, seed: int, device: str,
                    threads: int | None, overwrite: bool, shown: Shown) -> AttackOutcome:
    """``attack classes``: every client's class set (and counts) inferred from its
    calibration uploads (``opts``: a ``ClassesOptions``); attack.json and classes.png into
    ``out`` (default RUN/attack-classes)."""
    from privfedcal.attacks.reconstruction.runner import load_run
    from privfedcal.attacks.reconstruction.scoring import plot_class_sets, write_records
    from privfedcal.attacks.reconstruction.uploads import infer_class_sets
    from privfedcal.attacks.release_attacks import attacked_calibrators

    if run is None and out is not None:  # refused before the quick run is trained
        check_fresh(out, CLASSES_FILES, overwrite=overwrite)
    if run is None:
        # the first calibrator an attack targets (ccvr): class sets from its uploads
        run = quick_run(attacked_calibrators()[0], out / "run" if out else None, seed=seed,
                        device=device, threads=threads, shown=shown)
    view = load_run(run, device=device)
    out_dir = out or Path(run) / "attack-classes"
    check_fresh(out_dir, CLASSES_FILES, overwrite=overwrite)
    with shown.progress("classes"):
        records, notes = infer_class_sets(view, opts)
    with all_or_nothing(out_dir, CLASSES_FILES) as paths:
        write_records(records, paths["attack.json"])
        plot_class_sets(records, paths["classes.png"])
    return AttackOutcome(records, notes, Path(run), out_dir, CLASSES_FILES, "classes")


def whole_for_cli(attack: Any, opts: Any, *, run: Path, out: Path | None, device: str,
                  overwrite: bool) -> AttackOutcome:
    """``attack <name>`` for a registered attack on the run as a whole (``disaggregate``):
    attack.json (and the attack's figure) into ``out`` (default RUN/attack-<name>)."""
    from privfedcal.attacks.reconstruction.scoring import write_records
    from privfedcal.attacks.view import load_run

    name = attack.name
    out_dir = out or Path(run) / f"attack-{name}"
    files = ("attack.json", *([attack.figure[0]] if attack.figure else []))
    check_fresh(out_dir, files, overwrite=overwrite)
    view = load_run(run, device=device)
    records, notes = attack.run(view, opts)
    if not records:
        raise UsageError(f"nothing to {name}: " + "; ".join(notes))
    with all_or_nothing(out_dir, files) as paths:
        write_records(records, paths["attack.json"])
        if attack.figure:
            attack.figure[1](records, paths[attack.figure[0]])
    return AttackOutcome(records, notes, Path(run), out_dir, files, name)
