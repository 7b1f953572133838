"""``privfedcal attack invert|classes``: attack what the server observed in a run.

``invert --stats`` inverts CCVR uploads (raw-feature baseline, class means, class
statistics), ``invert --gradients`` CReFF class gradients (and, with ``--updates``, a
simulated local model update); ``classes`` infers every client's class set;
``disaggregate`` differences the secure sums of a whole run into per-client values. Without
``--run`` a quick default run on digits is trained first. Outputs go to ``--out`` (default
RUN_DIR/attack-<kind>/): ``attack.json``, a PNG, and a summary table on stdout. Earlier
results there are kept unless ``--overwrite``; the files are renamed into place together
at the end, so a failed attack leaves nothing half-written. Progress (a bar, or lines on
stderr when piped) counts optimisation steps x restarts with an ETA (``runner.execute``'s
``Progress``). Ctrl-C or SIGTERM during ``invert`` writes the finished targets as a partial
attack.json (``attacks/reconstruction/resume.py``) and exits 130; the same command with ``--resume``
runs the other targets only.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated

import typer

from privfedcal.attacks.reconstruction.feature_inversion import (
    DEFAULT_ATTACK_BATCH,
    DEFAULT_MAX_STEPS,
)
from privfedcal.cli.args import run_folder
from privfedcal.cli.console import Reporter, console, print_table
from privfedcal.errors import Interrupted, UsageError
from privfedcal.report.output_folder import all_or_nothing, check_fresh

Opt = typer.Option

attack_app = typer.Typer(help="Attack what an honest-but-curious server observed in a run.",
                         no_args_is_help=True)

#: the quick run trained when no --run is given (digits; a few seconds on a CPU)
QUICK_RUN = dict(dataset="digits", clients=5, alpha=0.3, rounds=5, local_epochs=1, threads=1)
QUICK_CREFF = dict(match_steps=50, retrain_steps=100)


def set_threads(threads: int | None) -> None:
    """``--threads N``: torch intra-op threads for this process (None: torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


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


def quick_run(method: str, run_dir: Path | None, *, seed: int, device: str,
              threads: int | None = None, quiet: bool = False) -> Path:
    """Train a small ``method`` run on digits through the same code as ``privfedcal train``."""
    from privfedcal.cli.run_progress import run_with_progress
    from privfedcal.config import RunConfig
    from privfedcal.experiment import build_simulator

    if run_dir is None:
        run_dir = Path("runs") / f"quick-{method}-digits-{time.strftime('%Y%m%d-%H%M%S')}"
    if (run_dir / "summary.json").exists():
        console.print(f"reusing the quick run in {run_dir}")
        return run_dir
    params = QUICK_CREFF if method == "creff" else {}
    quick = {**QUICK_RUN, "threads": threads or QUICK_RUN["threads"]}
    cfg = RunConfig(method=method, seed=seed, device=device, out=str(run_dir),
                    calibration_params=dict(params), **quick)  # type: ignore[arg-type]
    summary = run_with_progress(build_simulator(cfg, run_dir), cfg, quiet=quiet)
    console.print(f"no --run given: trained a quick {method} run on digits into {run_dir} "
                  f"(accuracy {summary['accuracy']:.4f})")
    return run_dir


def print_notes(notes: list[str]) -> None:
    for note in dict.fromkeys(notes):  # once each, in order
        console.print(f"[yellow]note:[/yellow] {note}")


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


@attack_app.command("invert")
def invert(
    stats: Annotated[bool, Opt("--stats", help="Invert CCVR class statistics (and means).")] = False,
    gradients: Annotated[bool, Opt("--gradients", help="Invert CReFF class gradients.")] = False,
    updates: Annotated[bool, Opt("--updates", help="Invert the recorded per-client model updates (a simulated one if the transcript has none); alone or with --gradients.")] = False,
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack (default: train a quick digits run).")] = None,
    steps: Annotated[int, Opt(help="Step cap per inversion (each stops earlier once converged); lower it for a quick look.")] = DEFAULT_MAX_STEPS,
    restarts: Annotated[int, Opt(help="Random restarts per inversion (best kept).")] = 4,
    attack_batch: Annotated[int, Opt(help="Targets optimised together per batch (1: one at a time; same results, more memory).")] = DEFAULT_ATTACK_BATCH,
    clients: Annotated[str | None, Opt(help="Client ids to attack, e.g. 0,3 (default: the first two).")] = None,
    classes: Annotated[str | None, Opt(help="Classes to attack, e.g. 1,7 (default: all present).")] = None,
    round_: Annotated[int | None, Opt("--round", help="Release round (default: the last).")] = None,
    raw_samples: Annotated[int, Opt(help="Real images per client/class for the raw-feature baseline (0: none).")] = 3,
    max_n: Annotated[int, Opt(help="Largest class-stats batch to invert.")] = 256,
    update_batch: Annotated[int, Opt(help="Local batch of the simulated model update.")] = 4,
    rounds_combined: Annotated[int, Opt(help="CReFF releases of one client and class inverted together (1: one release at a time).")] = 3,
    known_classes: Annotated[bool, Opt("--known-classes", help="Also attack held classes that noise hides (attacker knows the label set).")] = False,
    seed: Annotated[int, Opt(help="Seed of the attacks (and of the quick run).")] = 0,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-<kind>).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
    resume: Annotated[bool, Opt("--resume", help="Finish an interrupted attack in the output folder (same settings): only the targets its partial attack.json lacks are run.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """Reconstruct client images from what the server saw; score them against the truth."""
    set_threads(threads)
    from privfedcal.attacks.reconstruction.resume import PARTIAL_IMAGES, job_keys
    from privfedcal.attacks.reconstruction.runner import (
        AttackOptions,
        Stopped,
        execute,
        load_run,
        sigterm_interrupts,
    )
    from privfedcal.attacks.reconstruction.scoring import records_table, save_grid, write_records
    from privfedcal.attacks.release_attacks import release_attack

    if resume and overwrite:
        raise UsageError("--resume keeps the finished targets, --overwrite discards them: "
                         "give one")
    if stats and gradients or not (stats or gradients or updates):
        raise UsageError("give exactly one of --stats or --gradients (and/or --updates)")
    if updates and stats:
        raise UsageError("--updates goes with --gradients or alone, not with --stats")
    kind = "stats" if stats else "gradients" if gradients else "updates"
    opts = AttackOptions(steps=steps, restarts=restarts, raw_samples=raw_samples, max_n=max_n,
                         update_batch=update_batch, round=round_, seed=seed,
                         known_classes=known_classes, rounds_combined=rounds_combined,
                         attack_batch=attack_batch)
    client_ids, class_ids = parse_ints(clients, "--clients"), parse_ints(classes, "--classes")
    run = run_folder(run_dir, run, "attack invert", required=False)
    files = ("attack.json", "reconstructions.png")
    if run is None and out is not None and not resume:  # refused before the quick run
        check_fresh(out, files, overwrite=overwrite)
    if run is None:
        run = quick_run("ccvr" if stats else "creff", out / "run" if out else None, seed=seed,
                        device=device, threads=threads, quiet=quiet)
    view = load_run(run, device=device)
    # the attack registered under the flag's name (a calibrator's ReleaseSpec.attack);
    # --updates (the uplink's model updates) rides on the class-gradient attack
    if stats:
        plan = release_attack("stats").plan(view, opts, client_ids, class_ids)
    else:
        plan = release_attack("gradients").plan(view, opts, client_ids, class_ids,
                                                updates=updates, gradients=gradients)
    if not plan.jobs:
        raise UsageError("nothing to attack" + (": " + "; ".join(plan.notes) if plan.notes else ""))
    out_dir = out or Path(run) / f"attack-{kind}"
    settings = {"attack": kind, "run": str(Path(run).resolve()), "clients": client_ids,
                "classes": class_ids, **dataclasses.asdict(opts)}
    keys = job_keys([job.description for job in plan.jobs])
    done = earlier_targets(out_dir, files, settings, keys, resume=resume, overwrite=overwrite)
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


@attack_app.command("classes")
def classes_cmd(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack (default: train a quick digits run).")] = None,
    false_positive_rate: Annotated[float, Opt(help="Per-class false-positive rate under DP noise.")] = 1e-3,
    seed: Annotated[int, Opt(help="Seed of the quick run.")] = 0,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-classes).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).")] = False,
) -> None:
    """Infer each client's class set (and counts) from its calibration uploads."""
    set_threads(threads)
    from privfedcal.attacks.reconstruction.runner import AttackOptions, load_run
    from privfedcal.attacks.reconstruction.scoring import (
        classes_table,
        plot_class_sets,
        write_records,
    )
    from privfedcal.attacks.reconstruction.uploads import infer_class_sets

    opts = AttackOptions(false_positive_rate=false_positive_rate, seed=seed)
    run = run_folder(run_dir, run, "attack classes", required=False)
    files = ("attack.json", "classes.png")
    if run is None and out is not None:  # refused before the quick run is trained
        check_fresh(out, files, overwrite=overwrite)
    if run is None:
        run = quick_run("ccvr", out / "run" if out else None, seed=seed, device=device,
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


@attack_app.command("disaggregate")
def disaggregate_cmd(
    run_dir: Annotated[Path | None, typer.Argument(help="Run folder to attack (the same as --run).", show_default=False)] = None,
    run: Annotated[Path | None, Opt(help="Run folder to attack.")] = None,
    window: Annotated[int, Opt(help="Releases over which a changing value (update, class gradient) is taken as constant (0: the whole run).")] = 0,
    totals: Annotated[bool, Opt("--totals/--no-totals", help="Add the public all-clients totals (N for update weights, the public class totals for counts).")] = True,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "cpu",
    threads: Annotated[int | None, Opt(help="Torch threads (as for train; default: torch's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN_DIR/attack-disaggregate).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace earlier results in the output folder.")] = False,
) -> None:
    """Difference the run's secure sums over changing participant sets into per-client
    values (Lam et al., ICML 2021); say which clients and groups they determine."""
    set_threads(threads)
    from privfedcal.attacks.reconstruction.disaggregate_report import plot, table, verdicts
    from privfedcal.attacks.reconstruction.runner import AttackOptions, load_run
    from privfedcal.attacks.reconstruction.scoring import write_records
    from privfedcal.attacks.release_attacks import release_attack

    opts = AttackOptions(window=window, public_totals=totals)
    run = run_folder(run_dir, run, "attack disaggregate", required=True)
    out_dir = out or Path(run) / "attack-disaggregate"
    files = ("attack.json", "disaggregation.png")
    check_fresh(out_dir, files, overwrite=overwrite)
    view = load_run(run, device=device)
    # least squares on small matrices: well under a second, no progress to show
    records, notes = release_attack("disaggregate").run(view, opts)
    if not records:
        raise UsageError("nothing to disaggregate: " + "; ".join(notes))
    with all_or_nothing(out_dir, files) as paths:
        write_records(records, paths["attack.json"])
        plot(records, paths["disaggregation.png"])
    print_table(table(records, f"privfedcal attack disaggregate: {run}"))
    for line in verdicts(records):
        console.print(line)
    print_notes(notes)
    console.print(f"wrote attack.json and disaggregation.png into {out_dir}")


def register(app: typer.Typer) -> None:
    app.add_typer(attack_app, name="attack")
