"""privfedcal's Python API: run experiments, read their results, attack what the server saw,
and use CCVR's calibration with its protection from a federated loop of one's own.
``train``, ``resume`` and ``load_run`` are here; ``Run`` is in ``run.py``, ``attack`` in
``attacking.py``, CCVR's halves in ``ownloop.py``, the logger and progress bars in
``log.py``, the argument checks in ``arguments.py``, and the jobs of ``privfedcal attack``
as the command runs them in ``attack_jobs.py``.

Every name of ``__all__`` is re-exported by ``privfedcal`` (``privfedcal.__all__``);
``docs/api.md`` is the guide, with doctested examples. The functions run the same code as
the CLI (``privfedcal train`` / ``attack``) and write the same run folders, but ``train``
without ``out`` keeps its run in a temporary folder until ``Run.save``; progress shows as a
bar when interactive and goes to the ``privfedcal`` logger (``log.py``). Errors a user can
fix raise ``privfedcal.UsageError`` with one line (the CLI prints it and exits 2), which
names the keyword (``dp_eps``) where the CLI's names the flag (``--dp-eps``;
``arguments.py``). The halves the CLI calls after parsing its flags are public too and
named for it (``resume_simulator_for_cli``), their messages in flags. Numbers may be numpy
scalars wherever Python numbers are taken.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfedcal.api.arguments import coerce, python_surface, register_check
from privfedcal.api.attacking import attack, attack_kinds  # noqa: F401  (re-exported)
from privfedcal.api.ownloop import calibrate_head, ccvr_statistics, privatize_statistics
from privfedcal.api.run import Run, Scratch, check_progress, make_room
from privfedcal.errors import UsageError
from privfedcal.report.output_folder import check_writable
from privfedcal.settings.messages import SettingError
from privfedcal.settings.run_config import RunConfig

if TYPE_CHECKING:
    from privfedcal.federation.simulator import Simulator

__all__ = [
    "Run", "RunConfig", "UsageError", "attack", "calibrate_head", "ccvr_statistics",
    "load_run", "privatize_statistics", "resume", "resume_simulator", "train",
]

register_check("bool | Callable[[dict[str, Any]], None]", check_progress)  # a round's record


def config_from(config: RunConfig | Mapping[str, Any] | str | Path | None,
                settings: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a RunConfig, a mapping, a TOML / config.json path or nothing,
    with ``settings`` (RunConfig field names) overriding it; the settings of ``train`` and
    of the jobs that take a run's settings (``audit_dp``)."""
    from privfedcal.experiment import check_calibration_params, check_method
    from privfedcal.settings.catalogue import place_hyperparameters
    from privfedcal.settings.run_config import load_toml

    if isinstance(config, RunConfig):
        base = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        base = load_toml(config)
    else:
        base = dict(config or {})
    merged = {**_plain_settings(base), **_plain_settings(settings)}
    # a method hyperparameter or calibrator option by its own name, as its flag on the CLI
    cfg = RunConfig.from_dict(place_hyperparameters(merged))
    check_method(cfg.method)
    check_calibration_params(cfg)
    return cfg


def _plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each value of a known setting (the hyperparameters' tables
    included) made plain and of its type (``coerce``); the rest is judged by
    ``RunConfig.from_dict``."""
    from privfedcal.settings.catalogue import all_settings

    kinds = {s.name: s.type for s in all_settings() if s.scope != "flower"}
    out = dict(settings)
    for k, v in out.items():
        if kinds.get(k) is dict and isinstance(v, Mapping):
            out[k] = {n: coerce(x, kinds.get(n), n) for n, x in v.items()}
        elif k in kinds and kinds[k] is not dict:
            out[k] = coerce(v, kinds[k], k)
    return out


@python_surface
def train(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
          out: str | Path | None = None, overwrite: bool = False,
          progress: bool | Callable[[dict[str, Any]], None] | None = None,
          **settings: Any) -> Run:
    """Train one federated experiment and return its run.

    ``config``: a ``RunConfig``, a mapping of settings, or a TOML file / ``config.json``;
    keyword ``settings`` (``RunConfig`` field names: ``method="ccvr"``, ``dp_eps=8``)
    override it, and so do method hyperparameters and calibrator options by name
    (``mu=0.01``, ``match_steps=50``: the CLI's flags, each the keyword of its flag's name).
    Numbers may be numpy scalars.

    ``out``: the run folder. Without one (here or in ``config``) the run is kept in a
    temporary folder removed with the returned ``Run`` (``Run.save`` keeps it), so a cell
    re-run never collides with a previous run. A folder that already holds a run is
    refused unless ``overwrite`` (then it is replaced; only a folder with a ``config.json``
    is), and so is one that cannot be written.

    ``progress``: None (a bar when stderr is a terminal or in a notebook), True (a bar),
    False (none), or a callable called with each round's record instead of the bar. The
    ``privfedcal`` logger receives a line at the start, per evaluated round and at the end
    (``api/log.py``). Raises ``Diverged`` when the loss or model stops being finite (a
    folder given as ``out`` keeps what was written), ``UsageError`` on bad settings,
    ``PrivacyBudgetError`` when the budget cannot be met."""
    from privfedcal.api.log import run_simulator
    from privfedcal.experiment import build_simulator

    cfg = config_from(config, settings)
    scratch = None
    if out is not None or cfg.output.out:
        run_dir = Path(out) if out is not None else Path(str(cfg.output.out))
        make_room(run_dir, overwrite, "resume it, pick another out or give overwrite=True")
        check_writable(run_dir, flag="out")  # before the data are loaded and the model built
        cfg = cfg.replace(out=str(run_dir))
    else:  # in memory: config.json records no out until the run is saved
        scratch = Scratch()
        run_dir = scratch.path / _run_name(cfg)
    sim = build_simulator(cfg, run_dir)
    _plot(run_dir, run_simulator(sim, progress, _where(run_dir, scratch)))
    return Run(run_dir, scratch)


def _plot(run_dir: Path, summary: dict[str, Any]) -> None:
    """``accuracy.png``, as ``privfedcal train`` draws it after a run (Pillow, milliseconds)."""
    from privfedcal.report.accuracy_png import plot_accuracy_png

    plot_accuracy_png(run_dir / "metrics.jsonl", run_dir / "accuracy.png", summary)


def _where(run_dir: Path, scratch: Scratch | None) -> str:
    """Where a run is kept, for its first log line."""
    return str(run_dir) if scratch is None else f"memory (a temporary folder, {run_dir})"


def _run_name(cfg: RunConfig) -> str:
    """An in-memory run's folder name, as the CLI names its runs (``ccvr-digits-<time>``)."""
    import time

    return f"{cfg.method}-{cfg.data.dataset.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"


@python_surface
def resume_simulator(run_dir: str | Path, rounds: int | None = None,
                     threads: int | None = None) -> Simulator:
    """The simulator of an interrupted run restored from its checkpoint, or of a finished
    one extended to ``rounds``, ready to ``run()`` (see ``resume_simulator_for_cli``)."""
    return resume_simulator_for_cli(Path(run_dir), rounds, threads)


def resume_simulator_for_cli(run_dir: Path, rounds: int | None = None,
                             threads: int | None = None) -> Simulator:
    """The simulator of an interrupted run restored from its checkpoint, or of a finished
    one extended to ``rounds``, ready to ``run()`` (``privfedcal train --resume`` runs it;
    its messages name the CLI's flags).

    Rounds are seeded by their number, so an extended run ends with the same model as an
    uninterrupted run of ``rounds`` rounds. Refused: fewer rounds than trained, a diverged
    run (it would diverge again), and a different round count with DP (every release's
    noise was calibrated for the planned number of rounds)."""
    from privfedcal.experiment import build_simulator
    from privfedcal.federation.checkpoint import checkpoint_round
    from privfedcal.federation.hooks import Calibrator
    from privfedcal.settings.run_config import read_run_config

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    summary_file = run_dir / "summary.json"
    previous = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    if previous and previous.get("diverged"):
        d = previous["diverged"]
        raise SettingError("{run} diverged at round {round}; resuming would diverge again: "
                           "start a new run with a lower {lr}", run=run_dir, round=d.get("round"))
    done = checkpoint_round(run_dir)
    if rounds is not None and rounds != cfg.training.rounds:
        if rounds < done:
            raise SettingError("{run} has already trained {done} rounds; {rounds} must be "
                               ">= {done}", run=run_dir, done=done)
        if cfg.privacy.dp_enabled or cfg.privacy.dp_train:
            raise SettingError("{rounds} cannot change a DP run: the noise of its releases was "
                               "calibrated for {planned} rounds under {dp_eps}; start a new run "
                               "with the rounds you want", planned=cfg.training.rounds)
        cfg = cfg.replace(rounds=rounds)
    if previous is not None and done >= cfg.training.rounds:
        raise SettingError("{run} is already complete (see summary.json); extend it with "
                           "{rounds=} > {planned}", run=run_dir, rounds="N",
                           planned=cfg.training.rounds)
    if threads is not None:
        cfg = cfg.replace(threads=threads)
    sim = build_simulator(cfg, run_dir)
    if (run_dir / "checkpoint").exists():
        sim.restore()
    if previous is not None:
        note = f"extended from {done} to {cfg.training.rounds} rounds"
        if type(sim.calibrator).after_training is not Calibrator.after_training:
            note += (f"; {cfg.calibrator}'s post-hoc step had already run on round {done}'s "
                     "model (its uploads, if any, stay in the transcript) and ran again on "
                     f"round {cfg.training.rounds}'s")
        sim.notes.append(note)
    return sim


@python_surface
def resume(run: Run | str | Path, rounds: int | None = None,
           progress: bool | Callable[[dict[str, Any]], None] | None = None) -> Run:
    """Continue an interrupted run, or extend a finished one to ``rounds`` (as
    ``privfedcal train --resume RUN --rounds N``; see ``resume_simulator``), in its own
    folder: an in-memory run stays in memory. ``progress`` and the log lines as in
    ``train``."""
    from privfedcal.api.log import run_simulator

    path = run.path if isinstance(run, Run) else Path(run)
    scratch = run.scratch if isinstance(run, Run) else None
    sim = resume_simulator_for_cli(path, rounds=rounds)
    _plot(path, run_simulator(sim, progress, _where(path, scratch)))
    return Run(path, scratch)


@python_surface
def load_run(path: str | Path) -> Run:
    """An existing run folder."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a run folder (no config.json)")
    return Run(path)
