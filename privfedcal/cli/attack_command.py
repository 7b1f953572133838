"""``privfedcal attack``: attack what the server observed in a run, one command per kind.

The commands come from the attack registry (``attacks/release_attacks.py``) when click asks
for them, so an attack registered by an imported module is there too: ``invert`` takes one
flag per registered attack with a planner (``--stats`` inverts CCVR uploads, ``--gradients``
CReFF class gradients, ``--updates`` the per-client model updates, alone or with the attack
it joins) and the options of the chosen attacks (each attack's options type: its fields
are the flags); every registered attack on the run as a whole is a command of its own
(``disaggregate`` differences the secure sums of a run into per-client values); ``classes``
infers every client's class set. Without ``--run`` a quick default run on digits is
trained first (``invert``, ``classes``), with the calibrator whose release the chosen
attack targets. Outputs go to ``--out`` (default RUN_DIR/attack-<kind>/): ``attack.json``,
a PNG, and a summary table on stdout. Earlier results there are kept unless
``--overwrite``; the files are renamed into place together at the end, so a failed attack
leaves nothing half-written. Progress (a bar, or lines on stderr when piped) counts
optimisation steps x restarts with an ETA (``runner.execute``'s ``Progress``). Ctrl-C or
SIGTERM during ``invert`` writes the finished targets as a partial attack.json
(``attacks/reconstruction/resume.py``) and exits 130; the same command with ``--resume``
runs the other targets only.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from privfedcal.cli.args import run_folder
from privfedcal.cli.attack_flags import (
    given_options,
    option_parameters,
    options_given,
    refuse_strays,
)
from privfedcal.cli.attack_whole_command import (
    print_notes,
    run_attack_command,
    set_threads,
)
from privfedcal.cli.console import Reporter, console, print_table
from privfedcal.cli.train_command import command_options
from privfedcal.errors import Interrupted, UsageError
from privfedcal.report.output_folder import all_or_nothing, check_fresh

Opt = typer.Option
KEYWORD = inspect.Parameter.KEYWORD_ONLY

#: the quick run trained when no --run is given (digits; a few seconds on a CPU)
QUICK_RUN = dict(dataset="digits", clients=5, alpha=0.3, rounds=5, local_epochs=1, threads=1)


class AttackGroup(TyperGroup):
    """``privfedcal attack``'s commands: ``classes``, and, built from the attack registry
    when click asks for them, ``invert`` and one command per attack on the run as a whole."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from privfedcal.attacks.release_attacks import run_attacks

        return ["invert", "classes", *(a.name for a in run_attacks())]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        from privfedcal.attacks.release_attacks import release_attack, run_attacks

        if name == "invert":
            return _click(name, invert_command())
        if name == "classes":
            return _click(name, classes_command())
        if name in {a.name for a in run_attacks()}:
            return _click(name, run_attack_command(release_attack(name)))
        return super().get_command(ctx, name)


attack_app = typer.Typer(cls=AttackGroup, no_args_is_help=True,
                         help="Attack what an honest-but-curious server observed in a run.")


def _click(name: str, func: Any) -> click.Command:
    """The click command typer makes of ``func``."""
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command(name)(func)
    return typer.main.get_command(one)


def _offered() -> list[Any]:
    from privfedcal.attacks.release_attacks import plan_attacks

    return plan_attacks()


def parse_ints(text: str | None, flag: str) -> list[int] | None:
    """``"0,3"`` -> [0, 3]; None stays None."""
    if text is None:
        return None
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise UsageError(f"{flag} takes comma-separated integers >= 0, got {text!r}")
    return values


def quick_run(calibrator: str, run_dir: Path | None, *, seed: int, device: str,
              threads: int | None = None, quiet: bool = False) -> Path:
    """Train a small run on digits calibrated by ``calibrator`` through the same code as
    ``privfedcal train``, with the calibration options its attacks declare for a quick
    attack (``ReleaseAttack.audit_params``)."""
    from privfedcal.attacks.release_attacks import audit_params
    from privfedcal.cli.run_progress import run_with_progress
    from privfedcal.experiment import build_simulator
    from privfedcal.settings.run_config import METHOD_ALIASES, RunConfig

    method = calibrator
    if run_dir is None:
        run_dir = Path("runs") / f"quick-{method}-digits-{time.strftime('%Y%m%d-%H%M%S')}"
    if (run_dir / "summary.json").exists():
        console.print(f"reusing the quick run in {run_dir}")
        return run_dir
    quick = {**QUICK_RUN, "threads": threads or QUICK_RUN["threads"]}
    # ccvr and creff are methods of their own (FedAvg then the calibrator)
    how = {"method": method} if method in METHOD_ALIASES else {"method": "fedavg",
                                                                 "calibrate": calibrator}
    cfg = RunConfig(seed=seed, device=device, out=str(run_dir),
                    calibration_params=audit_params(calibrator), **how,
                    **quick)  # type: ignore[arg-type]
    summary = run_with_progress(build_simulator(cfg, run_dir), quiet=quiet)
    console.print(f"no --run given: trained a quick {method} run on digits into {run_dir} "
                  f"(accuracy {summary['accuracy']:.4f})")
    return run_dir


def clock(seconds: float | None) -> str:
    """``1:05:09``, ``4:09``; ``?`` for None."""
    if seconds is None:
        return "?"
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def show_progress(progress: Reporter, kind: str, p) -> None:
    """``execute``'s ``Progress`` on the bar (or log lines): optimisation steps of the
    planned total, targets done, ETA; a new line per batch. Until a target has stopped the
    ETA is the time to every step cap (``<=``); after, scaled by how far below the cap
    targets stopped (``~``, ``Progress.eta``)."""
    bound = "" if p.eta is None else "~" if p.stop_share is not None else "<= "
    progress.update(description=f"attack {kind}: {p.running or 'done'}",
                    completed=p.steps, total=max(p.total, 1),
                    info=f"steps x restarts, {p.targets}/{p.of} targets, "
                         f"ETA {bound}{clock(p.eta)}")


def earlier_targets(out_dir: Path, files: tuple[str, ...], settings: dict, keys: list[str],
                    *, resume: bool, overwrite: bool) -> dict | None:
    """The finished targets of a partial attack in ``out_dir`` with ``--resume`` (checked
    against ``settings`` and the plan's ``keys``); None otherwise, after refusing to
    replace earlier results without ``--overwrite``."""
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
                 stop) -> Interrupted:
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


def _invert_options(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack (default: train a quick digits run).")] = None,
    clients: Annotated[str | None, Opt(help="Client ids to attack, e.g. 0,3 (default: the first two).")] = None,
    classes: Annotated[str | None, Opt(help="Classes to attack, e.g. 1,7 (default: all present).")] = None,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-<kind>).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
    resume: Annotated[bool, Opt("--resume", help="Finish an interrupted attack in the output folder (same settings): only the targets its partial attack.json lacks are run.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """``invert``'s own options; the attack flags and their options come from the registry."""


def invert_command() -> Any:
    """``attack invert``: a flag per registered attack with a planner (its ``summary`` the
    help), then the options of every one of them (their options types' CLI fields)."""
    from privfedcal.attacks.attack_options import merged_flags

    attacks = _offered()
    offered = merged_flags(a.options for a in attacks)

    def invert(**flags: Any) -> None:
        """Reconstruct client images from what the server saw; score them against the truth."""
        run_invert(attacks, offered, flags)

    selectors = [inspect.Parameter(a.name, KEYWORD, default=False, annotation=Annotated[
        bool, Opt(f"--{a.name}", help=a.summary, rich_help_panel="Attacks")]) for a in attacks]
    invert.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        selectors + command_options(_invert_options) + option_parameters(offered.values()))
    return invert


def run_invert(attacks: list[Any], offered: dict[str, Any], flags: dict[str, Any]) -> None:
    """``attack invert`` with the given flags: plan the chosen attacks, run them as one
    batched plan, write attack.json and the PNG grid."""
    set_threads(flags["threads"])
    from privfedcal.attacks.reconstruction.resume import PARTIAL_IMAGES, job_keys
    from privfedcal.attacks.reconstruction.runner import (
        Stopped,
        execute,
        load_run,
        sigterm_interrupts,
    )
    from privfedcal.attacks.reconstruction.scoring import records_table, save_grid, write_records

    chosen, opts, kind = _chosen_attacks(attacks, offered, flags)
    client_ids = parse_ints(flags["clients"], "--clients")
    class_ids = parse_ints(flags["classes"], "--classes")
    out, device, quiet = flags["out"], flags["device"], flags["quiet"]
    files = ("attack.json", "reconstructions.png")
    run = _attacked_run(chosen, flags, files)
    plan = _joint_plan(chosen, opts, load_run(run, device=device), client_ids, class_ids)
    out_dir = out or Path(run) / f"attack-{kind}"
    settings = {"attack": kind, "attacks": [a.name for a in chosen],
                "run": str(Path(run).resolve()), "clients": client_ids, "classes": class_ids,
                **{k: v for o in opts.values() for k, v in dataclasses.asdict(o).items()}}
    keys = job_keys([job.description for job in plan.jobs])
    done = earlier_targets(out_dir, files, settings, keys, resume=flags["resume"],
                           overwrite=flags["overwrite"])
    try:
        with Reporter(f"attack {kind}: planning", total=1, quiet=quiet) as progress, \
                sigterm_interrupts():
            results = execute(plan, on_progress=lambda p: show_progress(progress, kind, p),
                              done=done)
    except Stopped as stop:
        raise keep_partial(out_dir, files, settings, keys, stop) from None
    records = [r.record for r in results]
    with all_or_nothing(out_dir, files) as paths:
        write_records(records, paths["attack.json"])
        save_grid(results, paths["reconstructions.png"],
                  title=f"{kind} attack on {run}: true (top) vs reconstructed (bottom)")
    (out_dir / PARTIAL_IMAGES).unlink(missing_ok=True)  # a resumed attack is whole now
    print_table(records_table(records, f"privfedcal attack invert --{kind}: {run}"))
    print_notes(plan.notes)
    console.print(f"wrote attack.json and reconstructions.png into {out_dir}")


def _chosen_attacks(attacks: list[Any], offered: dict[str, Any], flags: dict[str, Any]
                    ) -> tuple[list[Any], dict[str, Any], str]:
    """The attacks the flags choose (their flags popped), checked together, each with its
    options, and the name the run's outputs go under (the attack that does not join others)."""
    from privfedcal.attacks.release_attacks import check_combination

    if flags["resume"] and flags["overwrite"]:
        raise UsageError("--resume keeps the finished targets, --overwrite discards them: "
                         "give one")
    chosen = [a for a in attacks if flags.pop(a.name)]
    check_combination(chosen, attacks)
    refuse_strays(chosen, flags, offered, attacks)
    opts = {a.name: given_options(a, flags) for a in chosen}
    kind = next((a.name for a in chosen if not a.joins), chosen[0].name)
    return chosen, opts, kind


def _attacked_run(chosen: list[Any], flags: dict[str, Any], files: tuple[str, ...]) -> Any:
    """The run folder to attack: the one given, or a quick run of the first chosen attack's
    calibrator (under --out/run), after checking that --out holds no earlier attack."""
    from privfedcal.attacks.release_attacks import calibrator_of

    out = flags["out"]
    run = run_folder(flags["run_dir"], flags["run"], "attack invert", required=False)
    if run is None and out is not None and not flags["resume"]:  # refused before the quick run
        check_fresh(out, files, overwrite=flags["overwrite"])
    if run is None:
        calibrator = next(c for a in chosen if (c := calibrator_of(a)) is not None)
        run = quick_run(calibrator, out / "run" if out else None, seed=flags.get("seed") or 0,
                        device=flags["device"], threads=flags["threads"], quiet=flags["quiet"])
    return run


def _joint_plan(chosen: list[Any], opts: dict[str, Any], view: Any, client_ids: Any,
                class_ids: Any) -> Any:
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


def _classes_options(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack (default: train a quick digits run).")] = None,
    seed: Annotated[int, Opt(help="Seed of the quick run.")] = 0,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-classes).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """``classes``' own options; the inference's options are ``ClassesOptions``' fields."""


def classes_command() -> Any:
    """``attack classes``: its own options, then ``ClassesOptions``' CLI fields as flags
    (``--false-positive-rate``)."""
    from privfedcal.attacks.attack_options import option_flags
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions

    def classes(**flags: Any) -> None:
        """Infer each client's class set (and counts) from its calibration uploads."""
        run_classes(flags)

    classes.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        command_options(_classes_options)
        + option_parameters(f for f in option_flags(ClassesOptions) if f.cli))
    return classes


def run_classes(flags: dict[str, Any]) -> None:
    """``attack classes`` with the given flags: infer the class sets, write attack.json
    and classes.png."""
    run_dir, run, seed, device, threads, out, overwrite, quiet = (flags[k] for k in (
        "run_dir", "run", "seed", "device", "threads", "out", "overwrite", "quiet"))
    set_threads(threads)
    from privfedcal.attacks.reconstruction.runner import load_run
    from privfedcal.attacks.reconstruction.scoring import (
        classes_table,
        plot_class_sets,
        write_records,
    )
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions, infer_class_sets
    from privfedcal.attacks.release_attacks import attacked_calibrators

    opts = options_given(ClassesOptions, flags, "attack classes")
    run = run_folder(run_dir, run, "attack classes", required=False)
    files = ("attack.json", "classes.png")
    if run is None and out is not None:  # refused before the quick run is trained
        check_fresh(out, files, overwrite=overwrite)
    if run is None:
        # the first calibrator an attack targets (ccvr): class sets from its uploads
        run = quick_run(attacked_calibrators()[0], out / "run" if out else None, seed=seed, device=device,
                        threads=threads, quiet=quiet)
    view = load_run(run, device=device)
    out_dir = out or Path(run) / "attack-classes"
    check_fresh(out_dir, files, overwrite=overwrite)
    with Reporter("attack classes: inferring every client's class set", quiet=quiet):
        records, notes = infer_class_sets(view, opts)
    with all_or_nothing(out_dir, files) as paths:
        write_records(records, paths["attack.json"])
        plot_class_sets(records, paths["classes.png"])
    print_table(classes_table(records, f"privfedcal attack classes: {run}"))
    print_notes(notes)
    console.print(f"wrote attack.json and classes.png into {out_dir}")


def register(app: typer.Typer) -> None:
    app.add_typer(attack_app, name="attack")
