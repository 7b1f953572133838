"""``privfedcal train``: run one federated experiment into a run folder (and ``--resume`` it)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from privfedcal.errors import UsageError
from privfedcal.experiment import check_calibration_params, check_method, method_choices
from privfedcal.report.output_folder import check_writable
from privfedcal.settings.catalogue import Setting, cli_settings, place_hyperparameters
from privfedcal.settings.run_config import RunConfig, load_toml

Opt = typer.Option
#: flags ``--resume`` accepts: everything else would change the run
RESUME_FLAGS = ("rounds", "threads")


def setting_options(settings: Iterable[Setting]) -> list[inspect.Parameter]:
    """typer options for ``settings`` (privfedcal/settings/catalogue.py): the flag, help text, help
    group and shown default come from the description; every option defaults to None
    ("not given"), so that a settings file's value is only overridden by a given flag."""
    params = []
    for s in settings:
        option = Opt(*s.param_decls, help=s.help, show_default=s.shown_default or False,
                     rich_help_panel=s.group)
        params.append(inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[s.type | None, option]))
    return params


def command_options(func: Callable[..., Any]) -> list[inspect.Parameter]:
    """The options a command declares itself (``func``'s parameters), as keyword-only."""
    return [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(func, eval_str=True).parameters.values()]


def resolve_config(config_file: Path | None, flags: dict[str, Any]) -> RunConfig:
    """The config file first, then every flag the user gave (flags override the file; a
    hyperparameter's flag its entry of the file's table)."""
    merged: dict[str, Any] = load_toml(config_file) if config_file else {}
    merged.update({k: v for k, v in flags.items() if v is not None})
    cfg = RunConfig.from_dict(place_hyperparameters(merged))
    check_method(cfg.method)
    return cfg


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.data.dataset.split(":")[0]
    return Path("runs") / f"{cfg.method}-{name}-{stamp}"


def choices_epilog() -> str:
    """The registries' names, for ``train --help`` (built only when help is shown)."""
    import privfedcal.calibration  # noqa: F401  (registers the calibrators)
    from privfedcal.data.datasets import DATASETS
    from privfedcal.federation.hooks import CALIBRATORS
    from privfedcal.models import MODELS

    return (f"Methods: {', '.join(method_choices())}.  Models: {', '.join(MODELS.names())}.  "
            f"Datasets: {', '.join(d + (':PATH' if d in ('imagefolder', 'npz') else '') for d in DATASETS)}.  "
            f"Calibrators: {', '.join(CALIBRATORS.names())}.  Settings shown 'per model' come "
            "from the table in docs/usage.md and are printed at start.")


class TrainCommand(TyperCommand):
    """``train --help`` lists the registered methods, models and datasets."""

    def format_help(self, ctx, formatter):  # type: ignore[no-untyped-def]
        self.epilog = choices_epilog()
        return super().format_help(ctx, formatter)


def _train_options(
    config: Annotated[Path | None, Opt(help="TOML file of settings, or a run's config.json (re-runs it); flags override it.", rich_help_panel="Output")] = None,
    resume: Annotated[Path | None, Opt(help="Continue the run in this folder from its checkpoint (with --rounds N: extend it to N rounds).", rich_help_panel="Output")] = None,
    report: Annotated[bool, Opt("--report/--no-report", help="Write RUN_DIR/report.html at the end (privfedcal report).", rich_help_panel="Output")] = False,
    log: Annotated[str | None, Opt(help="Extra live log: tensorboard (needs the tensorboard extra).", rich_help_panel="Output")] = None,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress (bar, or lines on stderr when not on a terminal).", rich_help_panel="Output")] = False,
) -> None:
    """``train``'s options that are not settings of the run."""


# Its options, one per declared setting, are assembled when click builds the command (below);
# cli/command_signatures.py writes them out as a plain signature.
def train(**flags: Any) -> None:
    """Train with a federated method (and a calibrator) and write a run folder."""
    config, resume, report, log, quiet = (flags.pop(k, None) for k in
                                          ("config", "resume", "report", "log", "quiet"))
    rounds, threads = flags.get("rounds"), flags.get("threads")
    from privfedcal.cli.run_progress import execute, resume_run
    from privfedcal.federation.runlog import parse_log

    extras: dict[str, Any] = {"log": parse_log(log), "report_html": bool(report), "quiet": bool(quiet)}

    if resume is not None:
        other = [k for k, v in flags.items() if v is not None and k not in RESUME_FLAGS]
        if config is not None:
            other.append("config")
        if other:
            names = ", ".join("--" + k.replace("_", "-") for k in other)
            raise UsageError(f"--resume continues {resume} with its own settings and takes "
                             f"only --rounds N (to extend it) and --threads; refused: {names}")
        resume_run(resume, rounds=rounds, threads=threads, **extras)
        return
    cfg = resolve_config(config, flags)
    check_calibration_params(cfg)
    run_dir = Path(cfg.output.out) if cfg.output.out else default_run_dir(cfg)
    check_writable(run_dir)  # before the data are loaded and the model built
    if (run_dir / "checkpoint").exists() or (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    execute(cfg.replace(out=str(run_dir)), run_dir, **extras)


# The options are derived from the settings' description (plus ``_train_options``).
train.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    setting_options(cli_settings()) + command_options(_train_options))


def register(app: typer.Typer) -> None:
    app.command("train", cls=TrainCommand)(train)
