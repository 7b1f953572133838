"""Every job of the CLI besides training and attacking, as a function of the Python API:
compare runs, analyze a run, audit protection settings (the reconstruction sweep and the DP
distinguishing games), show a partition, write a report page (docs/api.md, "Every job").

Each public function takes its command's flags as keywords (``--max-clients`` is
``max_clients``), checks its arguments by their annotations (``pysurface.python_surface``),
raises ``UsageError`` whose message names keywords, returns its results as Python values and
writes files only where its docstring says. Each has an unwrapped half (``_compare``, ...)
that the CLI's command calls after parsing its flags; its messages name the flags, and the
command prints what it returns (``privfedcal/cli/``). The heavy code lives below:
``report/`` (comparison, pages), ``analysis/run_analysis.py``, ``attacks/reconstruction/leakage_sweep.py`` and
``attacks/distinguishing/games.py``, ``data/partition.py``.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from privfedcal.api import Run, _config
from privfedcal.config import RunConfig
from privfedcal.errors import UsageError
from privfedcal.pysurface import _coerce, python_surface, register_check
from privfedcal.report.output_folder import all_or_nothing, check_fresh, check_writable
from privfedcal.results import DPAuditRow

if TYPE_CHECKING:
    import numpy as np

    from privfedcal.attacks.reconstruction.leakage_sweep import AuditConfig

__all__ = ["Audit", "Comparison", "DPAudit", "Partition", "Stage", "analyze", "audit",
           "audit_dp", "compare", "partition", "write_report"]

P = ParamSpec("P")
R = TypeVar("R")

COMPARE_FILES = ("compare.csv", "compare.html")
AUDIT_FILES = ("audit.csv", "audit.png")
PARTITION_FILES = ("partition.png", "partition.json")
#: the RunConfig fields a partition depends on (the rest of a settings file is ignored)
PARTITION_KEYS = ("dataset", "data_root", "download", "clients", "partition", "alpha",
                  "imbalance_factor", "shards_per_client", "min_size", "seed", "data_seed")


# ---- results and progress ---------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """Progress of a long job: what it is doing, ``done`` of ``total`` (None: not counted).
    A job that reports its start (``audit``) does so with an empty ``description``, once
    its input is checked."""

    description: str
    done: int = 0
    total: int | None = None


@dataclass(frozen=True)
class Comparison:
    """``compare``'s result: one row per run (``compare.csv``'s columns,
    ``report/comparison.py`` ``COLUMNS``, with ``budget``, ``flag`` and ``curve``: the
    (round, accuracy) of each evaluated round), the warnings of runs that are not
    comparable, one line per setting that differs between the runs, and the files written
    (None: none)."""

    rows: list[dict[str, Any]]
    warnings: list[str]
    differing: list[str]
    csv: Path | None = None
    html: Path | None = None


@dataclass(frozen=True)
class Audit:
    """``audit``'s result: one row per (method, eps, secagg) setting (``audit.csv``'s
    columns, ``attacks/reconstruction/leakage_sweep.py`` ``COLUMNS``) and the folder holding ``audit.csv``,
    ``audit.png`` and the runs (None: nothing was kept)."""

    rows: list[dict[str, Any]]
    folder: Path | None = None


@dataclass(frozen=True)
class DPAudit:
    """``audit_dp``'s result: one row per channel game or one-run audit (``dp_audit.csv``'s
    columns, ``attacks/distinguishing/games.py`` ``COLUMNS``: ``eps_lower`` beside ``claimed_eps``) and
    the folder holding ``dp_audit.csv`` and ``dp_audit.png`` (None: nothing written)."""

    rows: list[DPAuditRow]
    folder: Path | None = None


@dataclass(frozen=True, eq=False)  # arrays have no truth value: compare the fields
class Partition:
    """``partition``'s result: ``counts[k, c]``, the samples of class c client k holds;
    ``indices[k]``, client k's training-set indices; ``summary``, ``partition.json``'s
    dict; and the files written (empty: none)."""

    counts: np.ndarray
    indices: list[np.ndarray]
    classes: list[str]
    title: str
    summary: dict[str, Any]
    files: tuple[Path, ...] = ()

    @property
    def sizes(self) -> list[int]:
        """Samples each client holds."""
        return [int(n) for n in self.counts.sum(axis=1)]


def _report(progress: Callable[[Stage], None] | None, stage: Stage) -> None:
    if progress is not None:
        progress(stage)


class _Watch:
    """What a job shows from Python, as ``train`` and ``attack`` do (``api_log.py``): its
    start, each new stage and its end at INFO on the ``privfedcal`` logger, and a bar when
    ``progress`` asks for one (None: when interactive; True: always; False: none), or the
    caller's callable. The watch is the ``progress`` given to the job's unwrapped half."""

    def __init__(self, progress: bool | Callable[[Stage], None] | None, name: str) -> None:
        self.progress, self.name = progress, name
        self.bar: Any = None
        self.opened, self.stage = False, ""

    def __enter__(self) -> _Watch:
        from privfedcal.api_log import logger

        logger.info("%s: started", self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        from privfedcal.api_log import logger

        if self.bar is not None:
            self.bar.close()
        if exc[0] is None:
            logger.info("%s: done", self.name)

    def __call__(self, stage: Stage) -> None:
        from privfedcal.api_log import logger, open_bar

        if callable(self.progress):
            self.progress(stage)
        if stage.description and stage.description != self.stage:
            self.stage = stage.description
            logger.info("%s: %s", self.name, stage.description)
        if not self.opened and stage.total is not None:  # the total is known from here
            self.opened, self.bar = True, open_bar(self.progress, self.name, stage.total,
                                                   stage.done)
        if self.bar is not None and stage.total is not None:
            self.bar.update(stage.done, stage.total, stage.description)


# ---- how arguments and messages read from Python -----------------------------------------------

def _keywords_of(func: Callable[..., Any]) -> dict[str, str]:
    """Each flag a job's messages may name, as its keyword: ``--max-clients`` is
    ``max_clients``, ``--overwrite`` (a flag that turns on) ``overwrite=True``,
    ``--no-one-run`` ``one_run=False``."""
    table = {}
    for p in inspect.signature(func).parameters.values():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        flag = "--" + p.name.replace("_", "-")
        table[flag] = f"{p.name}=True" if p.default is False else p.name
        if p.default is True:
            table["--no-" + flag[2:]] = f"{p.name}=False"
    return table


def _job(func: Callable[P, R]) -> Callable[P, R]:
    """``func`` as the API's: arguments checked by annotation, and the job's own flags in an
    error's message as its keywords (then the settings' flags, by ``python_surface``)."""
    table = _keywords_of(func)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(table, key=len,
                                                                         reverse=True)))
                         + r")(?![\w-])")

    @functools.wraps(func)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except UsageError as exc:
            exc.args = (pattern.sub(lambda m: table[m.group()], str(exc)),)
            raise
    return python_surface(call)


def _run_path(run: Run | str | Path) -> Path:
    return Path(run.path) if isinstance(run, Run) else Path(run)


def _runs(value: Any, name: str, optional: bool) -> list[Path] | None:
    """Run folders: one (a ``Run``, str or Path) or an iterable of them."""
    if value is None and optional:
        return None
    if isinstance(value, (Run, str, Path)):
        value = [value]
    if not isinstance(value, Iterable):
        raise UsageError(f"{name} must be run folders (Run, str or Path), got {value!r}")
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, (Run, str, Path)):
            raise UsageError(f"{name}[{i}] must be a run folder (Run, str or Path), got {v!r}")
        out.append(_run_path(v))
    return out


def _several(kind: type) -> Callable[[Any, str, bool], Any]:
    """One value of ``kind`` or an iterable of them, as a tuple without repeats."""
    def check(value: Any, name: str, optional: bool) -> tuple[Any, ...] | None:
        if value is None and optional:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            value = [value]
        return tuple(dict.fromkeys(_coerce(v, kind, f"{name}[{i}]", False)
                                   for i, v in enumerate(value)))
    return check


def _callable(value: Any, name: str, optional: bool) -> Any:
    if (value is None and optional) or callable(value):
        return value
    raise UsageError(f"{name} must be callable, got {value!r}")


def _tuple(value: Any) -> tuple[Any, ...]:
    """One value or several as a tuple (the checks above already made it one)."""
    return tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else (value,)


register_check("bool", lambda v, n, o: _coerce(v, bool, n, o))
register_check("Iterable[Run | str | Path]", _runs)
register_check("float | Iterable[float]", _several(float))
register_check("bool | Iterable[bool]", _several(bool))
register_check("str | Iterable[str]", _several(str))
register_check("bool | Callable[[Stage], None]", lambda v, n, o: v if isinstance(v, bool)
               else _callable(v, n, o))


# ---- compare ----------------------------------------------------------------------------------

def _compare(runs: list[Path], out: Path | None = None, overwrite: bool = False) -> Comparison:
    """``privfedcal compare``: the runs' rows, written to ``out`` when given (an earlier
    comparison there is kept unless ``overwrite``; both files or neither)."""
    from privfedcal.report import comparison as comparing

    if not runs:
        raise UsageError("compare needs at least one run folder: privfedcal compare RUN... "
                         "(or --run RUN, repeated)")
    if out is not None:
        check_fresh(out, COMPARE_FILES, overwrite=overwrite, what="a comparison")
    rows, warnings = comparing.collect(runs)
    differing = comparing.differing_settings([dict(r, differs="") for r in rows])
    # the rows as returned: the writers' private keys left out, the accuracy curve kept
    shown = [{**{k: v for k, v in r.items() if not k.startswith("_")}, "curve": r["_curve"]}
             for r in rows]
    if out is None:
        return Comparison(shown, warnings, differing)
    with all_or_nothing(out, COMPARE_FILES) as paths:
        comparing.write_csv(rows, paths["compare.csv"])
        comparing.write_html(rows, warnings, paths["compare.html"])
    return Comparison(shown, warnings, differing, out / "compare.csv", out / "compare.html")


@_job
def compare(runs: Iterable[Run | str | Path], *, out: str | Path | None = None,
            overwrite: bool = False) -> Comparison:
    """Finished runs side by side, as ``privfedcal compare``: accuracy before and after
    calibration, worst class, epsilon, bytes, time; runs on different datasets, budgets or
    round counts flagged (``warnings``), and every setting that differs named
    (``differing``). Writes ``compare.csv`` and ``compare.html`` into ``out`` only when
    ``out`` is given (an earlier comparison there is kept unless ``overwrite=True``)."""
    paths = list(dict.fromkeys(_run_path(r) for r in runs))
    if not paths:
        raise UsageError("compare needs at least one run in runs")
    return _compare(paths, None if out is None else Path(out), overwrite)


# ---- analyze ----------------------------------------------------------------------------------

def _analyze(run_dir: Path, *, samples: int = 500, projections: int = 256,
             max_clients: int | None = None, device: str | None = None, write: bool = True,
             progress: Callable[[Stage], None] | None = None) -> dict[str, Any]:
    """``privfedcal analyze``: ``analysis.json``'s dict; with ``write``, it and the PNGs are
    written into the run folder."""
    from privfedcal.analysis.run_analysis import AnalysisOptions, analyze_run

    options = AnalysisOptions(samples=samples, projections=projections,
                              max_clients=max_clients, device=device)
    what, count = "retraining clients for CKA", {"done": 0, "total": 0}

    def on_start(k: int) -> None:
        count["total"] = k
        _report(progress, Stage(what, 0, k))

    def on_client(_c: int) -> None:
        count["done"] += 1
        _report(progress, Stage(what, count["done"], count["total"]))

    return analyze_run(run_dir, options, on_start=on_start, on_client=on_client, write=write)


@_job
def analyze(run: Run | str | Path, *, samples: int = 500, projections: int = 256,
            max_clients: int | None = None, device: str | None = None, write: bool = True,
            progress: bool | Callable[[Stage], None] | None = None) -> dict[str, Any]:
    """Classifier norms and singular values before and after calibration, client CKA per
    layer and class separability of a finished run, as ``privfedcal analyze`` (CCVR, Luo et
    al. 2021, figs. 1-3 and 6): the ``analysis.json`` dict. Like the command it writes
    ``analysis.json`` and its PNGs into the run folder; ``write=False`` writes nothing.
    ``progress``: a bar over the clients retrained for CKA when interactive (None), always
    (True) or never (False), or a callable given a ``Stage`` per client."""
    with _Watch(progress, "analyze") as watch:
        return _analyze(_run_path(run), samples=samples, projections=projections,
                        max_clients=max_clients, device=device, write=write, progress=watch)


# ---- audit: the reconstruction sweep ----------------------------------------------------------

def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    """Audited methods: registered, and each with a calibration upload to attack (refused
    before any run: without one, the audit has nothing to invert whatever the protection)."""
    from privfedcal.attacks.reconstruction.leakage_sweep import ATTACKED_CALIBRATORS
    from privfedcal.experiment import check_method

    out = tuple(dict.fromkeys(methods))
    if not out:
        raise UsageError("--methods needs at least one method (ccvr, creff)")
    for m in out:
        check_method(m)
    idle = [m for m in out if RunConfig(method=m).calibrator not in ATTACKED_CALIBRATORS]
    if idle:
        raise UsageError(f"--methods: {', '.join(idle)} upload(s) no calibration payload, so "
                         "the audit has nothing to attack; methods that upload one: "
                         f"{', '.join(ATTACKED_CALIBRATORS)}")
    return out


def _audit(config: AuditConfig, out: Path | None, *, overwrite: bool = False,
           progress: Callable[[Stage], None] | None = None) -> Audit:
    """``privfedcal audit``: train and attack every setting of ``config``. With ``out``,
    the runs go to ``out/runs`` and ``audit.csv`` and ``audit.png`` into ``out`` (an earlier
    audit there is kept unless ``overwrite``); without, the runs are trained in a temporary
    folder removed at the end."""
    from privfedcal.attacks.reconstruction.leakage_sweep import plot_audit, run_setting, write_csv

    if out is not None:
        check_fresh(out, (*AUDIT_FILES, "runs"), overwrite=overwrite, what="an audit")
        if overwrite and (out / "runs").is_dir():  # each setting trains afresh
            shutil.rmtree(out / "runs")
    scratch = tempfile.TemporaryDirectory(prefix="privfedcal-audit-") if out is None else None
    work = Path(scratch.name) if scratch is not None else out
    assert work is not None
    settings = config.settings()
    rows: list[dict[str, Any]] = []
    stage = Stage("", 0, len(settings))

    def say(description: str, done: int) -> None:
        nonlocal stage
        stage = Stage(description, done, len(settings))
        _report(progress, stage)

    try:
        say("", 0)  # started: the input is checked
        for i, s in enumerate(settings):
            say(f"{s.name}: training", i)

            def on_job(doing: str, name: str = s.name, i: int = i) -> None:
                say(f"{name}: {doing}", i)

            rows.append(run_setting(s, config, work, on_job=on_job))
            say(stage.description, i + 1)  # the setting is done: same stage, one more
    finally:
        if scratch is not None:
            scratch.cleanup()
    if out is not None:
        with all_or_nothing(out, AUDIT_FILES) as paths:
            write_csv(rows, paths["audit.csv"])
            plot_audit(rows, paths["audit.png"])
    return Audit(rows, out)


@_job
def audit(*, eps: float | Iterable[float] = (1.0, 2.0, 4.0, 8.0, math.inf),
          secagg: bool | Iterable[bool] = (False, True),
          methods: str | Iterable[str] = ("ccvr", "creff"), rounds: int = 5,
          participation: float = 1.0, steps: int | None = None, restarts: int = 2,
          attack_batch: int | None = None, clients: int = 5, attack_clients: int = 1,
          dataset: str = "digits", seed: int = 0, device: str = "cpu",
          out: str | Path | None = None, overwrite: bool = False,
          progress: bool | Callable[[Stage], None] | None = None) -> Audit:
    """Train and attack every protection setting of a grid, as ``privfedcal audit``: DP
    epsilon (``eps``; ``math.inf``: no DP) x secure aggregation (``secagg``) x ``methods``,
    one row per setting (accuracy, the best reconstruction's PSNR, class inference, what
    the secure sums determine, epsilon spent; docs/privacy-audit.md). ``steps`` and
    ``attack_batch`` default to the attack's (``DEFAULT_MAX_STEPS``,
    ``DEFAULT_ATTACK_BATCH``). With ``out``, the runs are kept in ``out/runs`` and
    ``audit.csv`` and ``audit.png`` written into ``out`` (an earlier audit there is kept
    unless ``overwrite=True``); without, the runs are trained in a temporary folder that is
    removed and nothing is written. ``progress``: a bar over the settings when interactive
    (None), always (True) or never (False), or a callable given a ``Stage`` per step of each
    setting (``done`` of ``total`` settings)."""
    from privfedcal.attacks.reconstruction.feature_inversion import (
        DEFAULT_ATTACK_BATCH,
        DEFAULT_MAX_STEPS,
    )
    from privfedcal.attacks.reconstruction.leakage_sweep import AuditConfig

    config = AuditConfig(
        eps=_tuple(eps), secagg=_tuple(secagg), methods=check_methods(_tuple(methods)),
        dataset=dataset,
        clients=clients, rounds=rounds, participation=participation,
        steps=DEFAULT_MAX_STEPS if steps is None else steps, restarts=restarts,
        attack_batch=DEFAULT_ATTACK_BATCH if attack_batch is None else attack_batch,
        attack_clients=attack_clients, seed=seed, device=device)
    with _Watch(progress, "audit") as watch:
        return _audit(config, None if out is None else Path(out), overwrite=overwrite,
                      progress=watch)


# ---- audit dp: the distinguishing games -------------------------------------------------------

def _audit_dp(cfg: RunConfig, out: Path | None, *, trials: int = 1_000_000,
              budget_s: float = 120.0, confidence: float = 0.95,
              channels: tuple[str, ...] | None = None, one_run: bool = True,
              progress: Callable[[Stage], None] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> DPAudit:
    """``privfedcal audit dp`` of the configuration ``cfg``: each channel's game (and, with
    ``one_run``, the one-run audits) in this process. With ``out``, ``dp_audit.csv`` is
    rewritten after each row (an interrupted audit keeps the rows it has) and
    ``dp_audit.png`` drawn at the end; ``on_row(row)`` is called as each row is done."""
    import torch

    from privfedcal.attacks.distinguishing.channels import build_channels
    from privfedcal.attacks.distinguishing.games import (
        CSV_NAME,
        PNG_NAME,
        check_game,
        play,
        plot,
        write_csv,
    )
    from privfedcal.privacy.releases import DPSGD_RELEASE, USER_DP_RELEASE

    if not (math.isfinite(budget_s) and budget_s > 0):
        raise UsageError(f"--budget-s must be a number of seconds > 0, got {budget_s}")
    check_game(trials, confidence)
    if cfg.threads:  # the games run in this process: the run's threads hold for them too
        torch.set_num_threads(cfg.threads)
    if out is not None:
        check_writable(out)  # before the games run
    # built before any progress: a configuration without a channel is refused at once
    games = build_channels(cfg.replace(out=None, transcript=False), channels)
    rows: list[Mapping[str, Any]] = []

    def done(row: dict[str, Any]) -> None:
        rows.append(row)
        if out is not None:
            write_csv(rows, out / CSV_NAME)
        if on_row is not None:
            on_row(row)

    def stage(text: str, total: int) -> Callable[[int, int], None]:
        _report(progress, Stage(text, 0, total))
        return lambda k, n: _report(progress, Stage(text, k, n))

    for ch in games:
        done(play(ch, trials, budget_s=budget_s, confidence=confidence,
                  progress=stage(f"{ch.name}, trials per side", trials)))
    calibration = [ch.name for ch in games if ch.name not in (DPSGD_RELEASE, USER_DP_RELEASE)]
    if one_run and calibration:  # the whole run's calibration uploads, one run
        from privfedcal.attacks.distinguishing.one_run import one_run as audit_one_run

        done(audit_one_run(cfg.replace(out=None, transcript=False), confidence=confidence,
                           budget_s=budget_s,
                           progress=stage(f"{calibration[0]} (one run), clients", cfg.clients)))
    if one_run and cfg.dp_train:  # the whole run's training under DP-SGD, one run
        from privfedcal.attacks.distinguishing.one_run_training import one_run_training

        done(one_run_training(cfg, per_client=200, confidence=confidence, budget_s=budget_s,
                              progress=stage("dp-sgd (one run), training rounds", cfg.rounds)))
    if out is not None:
        plot(rows, out / PNG_NAME)
    return DPAudit([cast(DPAuditRow, dict(r)) for r in rows], out)


@_job
def audit_dp(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
             run: Run | str | Path | None = None, trials: int = 1_000_000,
             budget_s: float = 120.0, confidence: float = 0.95,
             channels: str | Iterable[str] | None = None, one_run: bool = True,
             out: str | Path | None = None,
             progress: bool | Callable[[Stage], None] | None = None, **settings: Any) -> DPAudit:
    """Does the claimed epsilon hold? Empirical lower bounds on epsilon, one per channel, as
    ``privfedcal audit dp`` (docs/privacy-audit.md). The configuration is ``config`` with
    ``settings`` over it, as ``train`` takes them, or the run folder ``run``'s own (then
    neither is given). ``trials`` releases of each neighbouring dataset per channel, at
    most ``budget_s`` seconds each; ``channels`` (``ccvr-stats``, ``creff-grad``,
    ``dp-sgd``; default every one the configuration has); ``one_run`` adds the one-run
    audits (Steinke et al. 2023). Writes ``dp_audit.csv`` and ``dp_audit.png`` into ``out``
    only when ``out`` is given (``out=run`` puts them in the run's report, as the command
    does by default with ``--run``). ``progress``: a bar over each channel's trials when
    interactive (None), always (True) or never (False), or a callable given a ``Stage`` per
    batch of trials."""
    from privfedcal.attacks.distinguishing.channels import parse_channels
    from privfedcal.federation.runfolder import read_run_config

    if run is not None:
        given = sorted(settings) + (["config"] if config is not None else [])
        if given:
            raise UsageError("run audits the run's own settings; refused: " + ", ".join(given))
        if not _run_path(run).is_dir():
            raise UsageError(f"run {_run_path(run)}: no such run folder")
        cfg = read_run_config(_run_path(run))
    else:
        cfg = _config(config, settings)
    names = None if channels is None else parse_channels(",".join(_tuple(channels)))
    with _Watch(progress, "audit dp") as watch:
        return _audit_dp(cfg, None if out is None else Path(out), trials=trials,
                         budget_s=budget_s, confidence=confidence, channels=names,
                         one_run=one_run, progress=watch)


# ---- partition --------------------------------------------------------------------------------

def _partition(config: RunConfig | Mapping[str, Any] | str | Path | None,
               settings: Mapping[str, Any], out: Path | None = None,
               overwrite: bool = False) -> Partition:
    """``privfedcal partition``: the partition ``train`` draws for the same settings (the
    ``PARTITION_KEYS`` of ``config``, ``settings`` over them). With ``out``, the heatmap and
    ``partition.json`` are written there (an earlier partition is kept unless ``overwrite``;
    both files or neither)."""
    import json

    from privfedcal.config import load_toml
    from privfedcal.data import partition as partitioning
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition_plots import plot_partition
    from privfedcal.data.sizes import size_distribution

    if out is not None:
        check_fresh(out, PARTITION_FILES, overwrite=overwrite, what="a partition")  # first
    if isinstance(config, RunConfig):
        base = config.to_dict()
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        base = load_toml(config) if config else {}
    merged = {k: v for k, v in base.items() if k in PARTITION_KEYS}
    cfg = RunConfig.from_dict({**merged, **{k: v for k, v in settings.items() if v is not None}})
    spec = partitioning.PartitionSpec(
        scheme=cfg.partition, num_clients=cfg.clients, alpha=cfg.alpha,
        imbalance_factor=cfg.imbalance_factor, shards_per_client=cfg.shards_per_client,
        min_size=cfg.min_size)
    # drawn from --data-seed (a run's config.json records it), else --seed, as a run
    # without a protection draws it
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    data = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download)
    # with the data's domain or user ids (the domains and natural schemes read them)
    parts = partitioning.partition_dataset(data, spec, seed)
    counts = partitioning.class_counts(data.y_train.numpy(), parts, data.num_classes)
    title = f"{data.name}: {spec.scheme}, K={spec.num_clients}, seed={seed}"
    summary = {
        "dataset": data.name, "partition": spec.scheme, "clients": spec.num_clients,
        "alpha": spec.alpha, "imbalance_factor": spec.imbalance_factor,
        "shards_per_client": spec.shards_per_client, "min_size": spec.min_size, "seed": seed,
        "classes": data.classes, "num_train": data.num_train,
        "num_assigned": int(counts.sum()), "sizes": counts.sum(axis=1).tolist(),
        "class_totals": counts.sum(axis=0).tolist(), "counts": counts.tolist(),
        "size_distribution": size_distribution(counts.sum(axis=1)),
        **partitioning.client_sources(data, spec.scheme),  # client_domains / client_users
    }
    result = Partition(counts, parts, list(data.classes), title, summary)
    if out is None:
        return result
    with all_or_nothing(out, PARTITION_FILES) as paths:  # both files or neither
        plot_partition(counts, paths["partition.png"], classes=data.classes, title=title)
        paths["partition.json"].write_text(json.dumps(summary, indent=2) + "\n")
    return Partition(counts, parts, list(data.classes), title, summary,
                     tuple(out / n for n in PARTITION_FILES))


@_job
def partition(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
              out: str | Path | None = None, overwrite: bool = False,
              **settings: Any) -> Partition:
    """How a dataset splits over clients, as ``privfedcal partition``: the partition
    ``train`` draws for the same settings. ``config`` (a ``RunConfig``, a mapping, a TOML
    file or a run's ``config.json``) gives the settings, ``settings`` override them; only
    ``dataset``, ``data_root``, ``download``, ``clients``, ``partition``, ``alpha``,
    ``imbalance_factor``, ``shards_per_client``, ``min_size``, ``seed`` and ``data_seed``
    count (``config``'s others are ignored; another keyword is refused). Writes
    ``partition.png`` and ``partition.json`` into ``out`` only when ``out`` is given (an
    earlier partition there is kept unless ``overwrite=True``)."""
    from privfedcal.settings import settings_of

    unknown = sorted(set(settings) - set(PARTITION_KEYS))
    if unknown:
        raise UsageError(f"partition takes no setting {', '.join(unknown)}; it takes: "
                         f"{', '.join(PARTITION_KEYS)}")
    kinds = {s.name: s.type for s in settings_of(RunConfig, "run")}
    plain = {k: _coerce(v, kinds.get(k), k) for k, v in settings.items()}
    return _partition(config, plain, None if out is None else Path(out), overwrite)


# ---- report -----------------------------------------------------------------------------------

def page_path(folder: Path, out: Path | None) -> Path:
    """The page ``report`` writes: ``out`` ending in .html is its path, any other ``out`` a
    folder (made if needed) that gets ``report.html``; without ``out``, FOLDER/report.html."""
    if out is None:
        return folder / "report.html"
    return out if out.suffix.lower() in (".html", ".htm") else out / "report.html"


def _write_report(folder: Path, out: Path | None = None) -> Path:
    """``privfedcal report``: the page of a run folder (summary.json) or of an audit folder
    (audit.csv), written where ``page_path`` says; returns its path."""
    from privfedcal.report.audit_report import build_audit_report
    from privfedcal.report.run_report import build_run_report

    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    page = page_path(folder, out)
    check_writable(page.parent)
    if page.is_dir():
        raise UsageError(f"cannot write the report to {page}: it is a folder")
    if (folder / "audit.csv").is_file():
        return Path(build_audit_report(folder, page))
    if (folder / "summary.json").is_file() or (folder / "config.json").is_file():
        return Path(build_run_report(folder, page))
    raise UsageError(f"{folder} holds neither a run (summary.json) nor an audit (audit.csv)")


@_job
def write_report(folder: Run | str | Path, *, out: str | Path | None = None) -> Path:
    """One self-contained HTML page of a run folder or an audit folder (``audit``'s ``out``),
    as ``privfedcal report``: plots, tables, the privacy ledger; it opens from disk with no
    network. Written, as by the command, to ``FOLDER/report.html``, or to ``out`` (a path
    ending in .html, or a folder that gets ``report.html``); returns the page's path."""
    return _write_report(_run_path(folder), None if out is None else Path(out))
