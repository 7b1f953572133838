"""The audits as jobs: ``audit`` trains and attacks every protection setting of a grid (the
reconstruction sweep, ``attacks/reconstruction/leakage_sweep.py``); ``audit_dp`` plays the
distinguishing games of each DP channel (``attacks/distinguishing/``)."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from privfedcal.api import Run, config_from
from privfedcal.errors import UsageError
from privfedcal.jobs.job_surface import JobStep, Watch, as_tuple, job, report_step, run_path
from privfedcal.report.output_folder import all_or_nothing, check_fresh, check_writable
from privfedcal.results import DPAuditRow
from privfedcal.settings.messages import SettingError
from privfedcal.settings.run_config import RunConfig

if TYPE_CHECKING:
    from privfedcal.attacks.reconstruction.leakage_sweep import AuditConfig

AUDIT_FILES = ("audit.csv", "audit.png")


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


# ---- audit: the reconstruction sweep ----------------------------------------------------------

def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    """Audited methods: registered, and each with a calibration upload to attack (refused
    before any run: without one, the audit has nothing to invert whatever the protection)."""
    from privfedcal.attacks.reconstruction.leakage_sweep import ATTACKED_CALIBRATORS
    from privfedcal.experiment import check_method

    out = tuple(dict.fromkeys(methods))
    if not out:
        raise SettingError("{methods} needs at least one method (ccvr, creff)")
    for m in out:
        check_method(m)
    idle = [m for m in out if RunConfig.of(method=m).calibrator not in ATTACKED_CALIBRATORS]
    if idle:
        raise SettingError("{methods}: {idle} upload(s) no calibration payload, so the audit "
                           "has nothing to attack; methods that upload one: {attacked}",
                           idle=", ".join(idle), attacked=", ".join(ATTACKED_CALIBRATORS))
    return out


def audit_for_cli(config: AuditConfig, out: Path | None, *, overwrite: bool = False,
                  progress: Callable[[JobStep], None] | None = None) -> Audit:
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
    stage = JobStep("", 0, len(settings))

    def say(description: str, done: int) -> None:
        nonlocal stage
        stage = JobStep(description, done, len(settings))
        report_step(progress, stage)

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


@job
def audit(*, eps: float | Iterable[float] = (1.0, 2.0, 4.0, 8.0, math.inf),
          secagg: bool | Iterable[bool] = (False, True),
          methods: str | Iterable[str] = ("ccvr", "creff"), rounds: int = 5,
          participation: float = 1.0, steps: int | None = None, restarts: int | None = None,
          attack_batch: int | None = None, clients: int = 5, attack_clients: int = 1,
          dataset: str = "digits", seed: int = 0, device: str = "cpu",
          out: str | Path | None = None, overwrite: bool = False,
          progress: bool | Callable[[JobStep], None] | None = None) -> Audit:
    """Train and attack every protection setting of a grid, as ``privfedcal audit``: DP
    epsilon (``eps``; ``math.inf``: no DP) x secure aggregation (``secagg``) x ``methods``,
    one row per setting (accuracy, the best reconstruction's PSNR, class inference, what
    the secure sums determine, epsilon spent; docs/privacy/attacks.md). ``steps``, ``restarts``
    and ``attack_batch`` are the attacks' inversion options; not given, the audit's
    defaults (``inversion_options.audit_flags``: the attacks' own, but 2 restarts). With ``out``, the runs are kept in ``out/runs`` and
    ``audit.csv`` and ``audit.png`` written into ``out`` (an earlier audit there is kept
    unless ``overwrite=True``); without, the runs are trained in a temporary folder that is
    removed and nothing is written. ``progress``: a bar over the settings when interactive
    (None), always (True) or never (False), or a callable given a ``JobStep`` per step of each
    setting (``done`` of ``total`` settings)."""
    from privfedcal.attacks.reconstruction.leakage_sweep import AuditConfig

    given = dict(steps=steps, restarts=restarts, attack_batch=attack_batch)
    config = AuditConfig(
        eps=as_tuple(eps), secagg=as_tuple(secagg), methods=check_methods(as_tuple(methods)),
        dataset=dataset,
        clients=clients, rounds=rounds, participation=participation,
        attack_clients=attack_clients, seed=seed, device=device,
        **{k: v for k, v in given.items() if v is not None})
    with Watch(progress, "audit") as watch:
        return audit_for_cli(config, None if out is None else Path(out), overwrite=overwrite,
                             progress=watch)


# ---- audit dp: the distinguishing games -------------------------------------------------------

def audit_dp_for_cli(cfg: RunConfig, out: Path | None, *, trials: int = 1_000_000,
                     budget_s: float = 120.0, confidence: float = 0.95,
                     channels: tuple[str, ...] | None = None, one_run: bool = True,
                     progress: Callable[[JobStep], None] | None = None,
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
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise SettingError("{budget_s} must be a number of seconds > 0, got {got}",
                           got=budget_s)
    check_game(trials, confidence)
    if cfg.engine.threads:  # the games run in this process: the run's threads hold for them too
        torch.set_num_threads(cfg.engine.threads)
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
        report_step(progress, JobStep(text, 0, total))
        return lambda k, n: report_step(progress, JobStep(text, k, n))

    for ch in games:
        done(play(ch, trials, budget_s=budget_s, confidence=confidence,
                  progress=stage(f"{ch.name}, trials per side", trials)))
    if one_run:
        _one_run_audits(cfg, [ch.name for ch in games], confidence=confidence,
                        budget_s=budget_s, stage=stage, done=done)
    if out is not None:
        plot(rows, out / PNG_NAME)
    return DPAudit([cast(DPAuditRow, dict(r)) for r in rows], out)


def _one_run_audits(cfg: RunConfig, channels: list[str], *, confidence: float,
                    budget_s: float, stage: Callable[[str, int], Callable[[int, int], None]],
                    done: Callable[[dict[str, Any]], None]) -> None:
    """The one-run audits (Steinke et al. 2023) of ``audit dp``: the whole run's calibration
    uploads when a calibration channel was played, and its training under DP-SGD when the
    run trains with it; each row goes to ``done``."""
    from privfedcal.privacy.releases import DPSGD_RELEASE, USER_DP_RELEASE

    calibration = [c for c in channels if c not in (DPSGD_RELEASE, USER_DP_RELEASE)]
    if calibration:
        from privfedcal.attacks.distinguishing.one_run import one_run as audit_one_run

        done(audit_one_run(cfg.replace(out=None, transcript=False), confidence=confidence,
                           budget_s=budget_s,
                           progress=stage(f"{calibration[0]} (one run), clients",
                                          cfg.data.clients)))
    if cfg.privacy.dp_train:
        from privfedcal.attacks.distinguishing.one_run_training import one_run_training

        done(one_run_training(cfg, per_client=200, confidence=confidence, budget_s=budget_s,
                              progress=stage("dp-sgd (one run), training rounds",
                                             cfg.training.rounds)))


@job
def audit_dp(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
             run: Run | str | Path | None = None, trials: int = 1_000_000,
             budget_s: float = 120.0, confidence: float = 0.95,
             channels: str | Iterable[str] | None = None, one_run: bool = True,
             out: str | Path | None = None,
             progress: bool | Callable[[JobStep], None] | None = None, **settings: Any) -> DPAudit:
    """Does the claimed epsilon hold? Empirical lower bounds on epsilon, one per channel, as
    ``privfedcal audit dp`` (docs/privacy/auditing.md). The configuration is ``config`` with
    ``settings`` over it, as ``train`` takes them, or the run folder ``run``'s own (then
    neither is given). ``trials`` releases of each neighbouring dataset per channel, at
    most ``budget_s`` seconds each; ``channels`` (``ccvr-stats``, ``creff-grad``,
    ``dp-sgd``; default every one the configuration has); ``one_run`` adds the one-run
    audits (Steinke et al. 2023). Writes ``dp_audit.csv`` and ``dp_audit.png`` into ``out``
    only when ``out`` is given (``out=run`` puts them in the run's report, as the command
    does by default with ``--run``). ``progress``: a bar over each channel's trials when
    interactive (None), always (True) or never (False), or a callable given a ``JobStep`` per
    batch of trials."""
    from privfedcal.attacks.distinguishing.channels import parse_channels
    from privfedcal.settings.run_config import read_run_config

    if run is not None:
        given = sorted(settings) + (["config"] if config is not None else [])
        if given:
            raise UsageError("run audits the run's own settings; refused: " + ", ".join(given))
        if not run_path(run).is_dir():
            raise UsageError(f"run {run_path(run)}: no such run folder")
        cfg = read_run_config(run_path(run))
    else:
        cfg = config_from(config, settings)
    names = None if channels is None else parse_channels(",".join(as_tuple(channels)))
    with Watch(progress, "audit dp") as watch:
        return audit_dp_for_cli(cfg, None if out is None else Path(out), trials=trials,
                                budget_s=budget_s, confidence=confidence, channels=names,
                                one_run=one_run, progress=watch)
