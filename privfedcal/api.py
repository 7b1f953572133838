"""privfedcal's Python API: run experiments, read their results, attack what the server saw,
and use CCVR's calibration with its protection from a federated loop of one's own.

Every name here is re-exported by ``privfedcal`` (``privfedcal.__all__``); ``docs/api.md``
is the guide, with doctested examples. The functions run the same code as the CLI
(``privfedcal train`` / ``attack``) and write the same run folders, but ``train`` without
``out`` keeps its run in a temporary folder until ``Run.save``; progress shows as a bar
when interactive and goes to the ``privfedcal`` logger (``api_log.py``). Errors a user can
fix raise ``privfedcal.UsageError`` with one line (the CLI prints it and exits 2), which
names the keyword (``dp_eps``) where the CLI's names the flag (``--dp-eps``;
``pysurface.py``). Numbers may be numpy scalars wherever Python numbers are taken.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from privfedcal.config import RunConfig
from privfedcal.errors import UsageError
from privfedcal.ownloop import calibrate_head, ccvr_statistics, privatize_statistics
from privfedcal.pysurface import (
    _as_path,
    _coerce,
    _plain,
    options_of,
    python_surface,
    register_check,
)
from privfedcal.report.output_folder import check_writable

if TYPE_CHECKING:
    from privfedcal.attacks.reconstruction.progress import Progress
    from privfedcal.federation.setup import Experiment
    from privfedcal.federation.simulator import Simulator
    from privfedcal.results import AttackRecord, MetricsRow, Summary

__all__ = [
    "Run", "RunConfig", "UsageError", "attack", "calibrate_head", "ccvr_statistics",
    "load_run", "privatize_statistics", "resume", "resume_simulator", "train",
]


register_check("bool", lambda v, n, o: _coerce(v, bool, n, o))


def _check_progress(value: Any, name: str, optional: bool) -> Any:
    """``progress``: None (a bar when interactive), True, False or a callable."""
    value = _plain(value)
    if (value is None and optional) or isinstance(value, bool) or callable(value):
        return value
    raise UsageError(f"{name} must be callable, True or False, got {type(value).__name__}")


register_check("bool | Callable[[dict[str, Any]], None]", _check_progress)  # a round's record
register_check("bool | Callable[[Progress], None]", _check_progress)  # an attack's progress


# ---- runs -------------------------------------------------------------------------------------

def _read_json(text: str, where: str | Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where} is not valid JSON ({exc.msg})") from None


class Scratch:
    """A temporary folder that holds in-memory runs: removed when the last ``Run`` holding
    it is garbage-collected, or at interpreter exit."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="privfedcal-"))
        self._removal = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> Scratch:
        return self  # one owner: a copied Run shares the folder (and keeps it alive)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}  # unpickled (another process), it refers without owning


@dataclass(frozen=True)
class Run:
    """A run folder (``privfedcal train``'s or ``train()``'s), read lazily.

    ``path`` is the folder; ``config`` its settings (the experimenter's, with the data seed);
    ``summary`` and ``metrics`` the files of the same names; ``server_view`` the folder an
    auditor is given (``RUN/server``: public config, transcript, summary). A run trained
    without ``out`` is kept in a temporary folder that lives as long as the ``Run`` (and
    the runs ``resume`` makes of it): ``in_memory`` is then True, and ``save`` keeps it."""

    path: Path
    #: the temporary folder an in-memory run lives in (None for a folder of one's own)
    scratch: Scratch | None = field(default=None, repr=False, compare=False)

    @property
    def in_memory(self) -> bool:
        """True for a run in a temporary folder, removed with the ``Run`` (``save`` it)."""
        return self.scratch is not None

    @property
    def config(self) -> RunConfig:
        from privfedcal.federation.runfolder import read_run_config

        return read_run_config(self.path)

    @property
    def summary(self) -> Summary:
        """``summary.json``, typed (``privfedcal.results.Summary``; docs/api.md, "Result
        types"); keys of another version are kept untyped, a damaged file is a
        ``UsageError`` naming it."""
        from privfedcal.results import summary_from_dict

        file = self.path / "summary.json"
        if not file.is_file():
            raise UsageError(f"{self.path} has no summary.json: the run did not finish")
        return summary_from_dict(_read_json(file.read_text(), file), strict=False,
                                 where=str(file))

    @property
    def accuracy(self) -> float:
        """Test accuracy of the final (calibrated) model, a fraction."""
        accuracy = self.summary["accuracy"]
        if accuracy is None:  # a diverged run's summary
            raise UsageError(f"{self.path} has no accuracy: the run diverged (summary.json)")
        return float(accuracy)

    @property
    def metrics(self) -> list[MetricsRow]:
        """One record per evaluated round (``metrics.jsonl``), typed as ``summary``."""
        from privfedcal.results import metrics_row_from_dict

        file = self.path / "metrics.jsonl"
        if not file.is_file():
            return []
        return [metrics_row_from_dict(_read_json(line, f"{file}:{n}"), strict=False,
                                      where=f"{file}:{n}")
                for n, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]

    @property
    def server_view(self) -> Path:
        from privfedcal.federation.runfolder import server_dir

        return server_dir(self.path)

    @python_surface
    def experiment(self, device: str = "cpu") -> Experiment:
        """The run's experiment as the experimenter holds it (``federation/setup.py``
        ``Experiment``: ``data``, the clients' index tensors ``parts``, ``counts``, ``model``),
        its partition redrawn from the recorded data seed and ``model`` holding the final
        (calibrated) weights from ``final/``."""
        from privfedcal.federation.checkpoint import load_checkpoint
        from privfedcal.federation.setup import build_experiment

        exp = build_experiment(self.config.replace(device=device, workers=1))
        final = self.path / "final"
        if final.is_dir():
            exp.model.load_state_dict(load_checkpoint(final, exp.device)["model"])
        exp.model.eval()
        return exp

    def report(self) -> Path:
        """Write ``report.html`` (``privfedcal report``) and return its path."""
        from privfedcal.report.run_report import build_run_report

        return Path(build_run_report(self.path))

    @python_surface
    def save(self, path: str | Path, overwrite: bool = False) -> Run:
        """Copy the run to the folder ``path`` (the folder ``privfedcal train --out path``
        writes) and return it as a ``Run`` of its own. A ``path`` that holds a run is
        refused unless ``overwrite`` (then that run folder is replaced: only a folder with a
        ``config.json``, never another one); a non-empty folder that holds no run is
        refused either way. The saved ``config.json`` records ``path`` as the run's
        ``out``."""
        dest = Path(path)
        here = self.path.resolve()
        if dest.resolve() == here:
            return self
        if here in dest.resolve().parents:
            raise UsageError(f"cannot save {self.path} into itself ({dest})")
        _make_room(dest, overwrite, "pick another path or give overwrite=True")
        if dest.is_dir() and any(dest.iterdir()):
            raise UsageError(f"{dest} is not empty and holds no run: save into a new or "
                             "empty folder")
        check_writable(dest, flag="path")
        shutil.copytree(self.path, dest, dirs_exist_ok=True)
        from privfedcal.federation.runfolder import server_dir

        for folder in (dest, server_dir(dest)):
            record = folder / "config.json"
            if record.is_file():
                record.write_text(json.dumps({**json.loads(record.read_text()),
                                              "out": str(dest)}, indent=2))
        saved = Run(dest)
        if (dest / "report.html").is_file():  # it shows the settings, ``out`` included
            saved.report()
        return saved


register_check("Run | str | Path",
               lambda v, n, o: v if isinstance(v, Run) else _as_path(v, n, o))


def _config(config: RunConfig | Mapping[str, Any] | str | Path | None,
            settings: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a RunConfig, a mapping, a TOML / config.json path or nothing,
    with ``settings`` (RunConfig field names) overriding it."""
    from privfedcal.config import load_toml
    from privfedcal.experiment import check_calibration_params, check_method
    from privfedcal.settings import CALIBRATION_SETTINGS, METHOD_SETTINGS

    if isinstance(config, RunConfig):
        base = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        base = load_toml(config)
    else:
        base = dict(config or {})
    merged = {**_plain_settings(base), **_plain_settings(settings)}
    # a method hyperparameter or calibrator option by its own name, as its flag on the CLI
    for key, table in (("method_params", METHOD_SETTINGS),
                       ("calibration_params", CALIBRATION_SETTINGS)):
        named = [s.name for s in table if s.name in merged]
        if named and isinstance(merged.get(key, {}), Mapping):
            merged[key] = {**merged.get(key, {}), **{n: merged.pop(n) for n in named}}
    cfg = RunConfig.from_dict(merged)
    check_method(cfg.method)
    check_calibration_params(cfg)
    return cfg


def _plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each value of a known setting (the hyperparameters' tables
    included) made plain and of its type (``_coerce``); the rest is judged by
    ``RunConfig.from_dict``."""
    from privfedcal.settings import all_settings

    kinds = {s.name: s.type for s in all_settings() if s.scope != "flower"}
    out = dict(settings)
    for k, v in out.items():
        if kinds.get(k) is dict and isinstance(v, Mapping):
            out[k] = {n: _coerce(x, kinds.get(n), n) for n, x in v.items()}
        elif k in kinds and kinds[k] is not dict:
            out[k] = _coerce(v, kinds[k], k)
    return out


def _make_room(folder: Path, overwrite: bool, hint: str) -> None:
    """Refuse a ``folder`` that holds a run (its ``checkpoint/`` or ``summary.json``)
    unless ``overwrite``; with ``overwrite``, remove it if it is a run folder (a
    ``config.json`` in a real folder, not a link) and refuse a non-empty folder that is not
    one: only a run folder is ever deleted."""
    holds = (folder / "checkpoint").exists() or (folder / "summary.json").exists()
    if not overwrite:
        if holds:
            raise UsageError(f"{folder} already holds a run; {hint}")
        return
    if not folder.exists() or (folder.is_dir() and not folder.is_symlink()
                               and not any(folder.iterdir())):
        return
    if folder.is_symlink() or not folder.is_dir() or not (folder / "config.json").is_file():
        raise UsageError(f"{folder} is not a privfedcal run folder (no config.json): "
                         "overwrite=True replaces only a run folder")
    shutil.rmtree(folder)


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
    (``api_log.py``). Raises ``Diverged`` when the loss or model stops being finite (a
    folder given as ``out`` keeps what was written), ``UsageError`` on bad settings,
    ``PrivacyBudgetError`` when the budget cannot be met."""
    from privfedcal.api_log import run_simulator
    from privfedcal.experiment import build_simulator

    cfg = _config(config, settings)
    scratch = None
    if out is not None or cfg.out:
        run_dir = Path(out) if out is not None else Path(str(cfg.out))
        _make_room(run_dir, overwrite, "resume it, pick another out or give overwrite=True")
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
    from privfedcal.accuracy_png import plot_accuracy_png

    plot_accuracy_png(run_dir / "metrics.jsonl", run_dir / "accuracy.png", summary)


def _where(run_dir: Path, scratch: Scratch | None) -> str:
    """Where a run is kept, for its first log line."""
    return str(run_dir) if scratch is None else f"memory (a temporary folder, {run_dir})"


def _run_name(cfg: RunConfig) -> str:
    """An in-memory run's folder name, as the CLI names its runs (``ccvr-digits-<time>``)."""
    import time

    return f"{cfg.method}-{cfg.dataset.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"


@python_surface
def resume_simulator(run_dir: str | Path, rounds: int | None = None,
                     threads: int | None = None) -> Simulator:
    """The simulator of an interrupted run restored from its checkpoint, or of a finished
    one extended to ``rounds``, ready to ``run()`` (see ``_resume_simulator``)."""
    return _resume_simulator(Path(run_dir), rounds, threads)


def _resume_simulator(run_dir: Path, rounds: int | None = None,
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
    from privfedcal.federation.runfolder import read_run_config

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    summary_file = run_dir / "summary.json"
    previous = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    if previous and previous.get("diverged"):
        d = previous["diverged"]
        raise UsageError(f"{run_dir} diverged at round {d.get('round')}; resuming would "
                         "diverge again: start a new run with a lower --lr")
    done = checkpoint_round(run_dir)
    if rounds is not None and rounds != cfg.rounds:
        if rounds < done:
            raise UsageError(f"{run_dir} has already trained {done} rounds; --rounds must be "
                             f">= {done}")
        if cfg.dp_enabled or cfg.dp_train:
            raise UsageError(f"--rounds cannot change a DP run: the noise of its releases was "
                             f"calibrated for {cfg.rounds} rounds under --dp-eps; start a new "
                             "run with the rounds you want")
        cfg = cfg.replace(rounds=rounds)
    if previous is not None and done >= cfg.rounds:
        raise UsageError(f"{run_dir} is already complete (see summary.json); extend it "
                         f"with --rounds N > {cfg.rounds}")
    if threads is not None:
        cfg = cfg.replace(threads=threads)
    sim = build_simulator(cfg, run_dir)
    if (run_dir / "checkpoint").exists():
        sim.restore()
    if previous is not None:
        note = f"extended from {done} to {cfg.rounds} rounds"
        if type(sim.calibrator).after_training is not Calibrator.after_training:
            note += (f"; {cfg.calibrator}'s post-hoc step had already run on round {done}'s "
                     "model (its uploads, if any, stay in the transcript) and ran again on "
                     f"round {cfg.rounds}'s")
        sim.notes.append(note)
    return sim


@python_surface
def resume(run: Run | str | Path, rounds: int | None = None,
           progress: bool | Callable[[dict[str, Any]], None] | None = None) -> Run:
    """Continue an interrupted run, or extend a finished one to ``rounds`` (as
    ``privfedcal train --resume RUN --rounds N``; see ``resume_simulator``), in its own
    folder: an in-memory run stays in memory. ``progress`` and the log lines as in
    ``train``."""
    from privfedcal.api_log import run_simulator

    path = run.path if isinstance(run, Run) else Path(run)
    scratch = run.scratch if isinstance(run, Run) else None
    sim = _resume_simulator(path, rounds=rounds)
    _plot(path, run_simulator(sim, progress, _where(path, scratch)))
    return Run(path, scratch)


@python_surface
def load_run(path: str | Path) -> Run:
    """An existing run folder."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a run folder (no config.json)")
    return Run(path)


# ---- attacks ----------------------------------------------------------------------------------

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
    from privfedcal.api_log import AttackWatch
    from privfedcal.attacks.reconstruction.feature_inversion import DEFAULT_MAX_STEPS
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions
    from privfedcal.attacks.release_attacks import RELEASE_ATTACKS
    from privfedcal.attacks.view import load_run as load_view

    kinds = attack_kinds()
    if kind not in kinds:
        raise UsageError(f"attack kind must be one of {', '.join(kinds)}, got {kind!r}")
    kind_options = ClassesOptions if kind == "classes" else RELEASE_ATTACKS.get(kind).options
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
    plan = attack.plan(view, opts, ids, cls)
    if not plan.jobs:
        raise UsageError("nothing to attack" + (": " + "; ".join(plan.notes) if plan.notes else ""))
    done = execute(plan, lambda job: None, on_progress=on_progress)
    # typed by their writers (tests/package/test_results.py checks them against the types)
    return cast("list[AttackRecord]", [r.record for r in done])
