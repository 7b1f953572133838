"""``privfedcal train``: run one federated experiment into a run folder (and ``--resume`` it)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from privfedcal.config import RunConfig, load_toml
from privfedcal.errors import UsageError
from privfedcal.experiment import check_calibration_params, check_method, method_choices

Opt = typer.Option
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)
             if f.default is not dataclasses.MISSING}
#: flags ``--resume`` accepts: everything else would change the run
RESUME_FLAGS = ("rounds", "threads")


def _d(name: str) -> str:
    """The default shown by ``train --help``: RunConfig's, the one place defaults live."""
    if name in METHOD_FLAGS:
        return "the method's"
    if name in CALIBRATION_FLAGS:
        return "the calibrator's"
    value = _DEFAULTS[name]
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)

#: CLI flag -> method hyperparameter (Params field); None values keep the method's default
METHOD_FLAGS = ("mu", "tau", "beta", "server_lr", "lam")
#: CLI flag -> calibrator option
CALIBRATION_FLAGS = ("virtual_per_class", "virtual_mode", "tukey", "features_per_class",
                     "match_steps", "retrain_steps", "feature_lr", "creff_weighting")


def resolve_config(config_file: Path | None, flags: dict[str, Any]) -> RunConfig:
    """The config file first, then every flag the user gave (flags override the file)."""
    merged: dict[str, Any] = load_toml(config_file) if config_file else {}
    for key in ("method_params", "calibration_params"):
        merged[key] = dict(merged.get(key, {}))
    for k in METHOD_FLAGS:
        if flags.get(k) is not None:
            merged["method_params"][k] = flags[k]
    for k in CALIBRATION_FLAGS:
        if flags.get(k) is not None:
            merged["calibration_params"][k] = flags[k]
    for k, v in flags.items():
        if k not in METHOD_FLAGS and k not in CALIBRATION_FLAGS and v is not None:
            merged[k] = v
    cfg = RunConfig.from_dict(merged)
    check_method(cfg.method)
    return cfg


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.dataset.split(":")[0]
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


def train(
    method: Annotated[str | None, Opt(help="Local method or shorthand (ccvr, creff).", show_default=_d('method'))] = None,
    dataset: Annotated[str | None, Opt(help="digits | cifar10 | cifar100 | stl10 | imagefolder:PATH | npz:PATH", show_default=_d('dataset'))] = None,
    data_root: Annotated[str | None, Opt(help="Folder holding the dataset files.", show_default=_d('data_root'))] = None,
    download: Annotated[bool | None, Opt("--download/--no-download", help="Download if missing (needs network).", show_default=_d('download'))] = None,
    model: Annotated[str | None, Opt(help="Model (default: the dataset's).", show_default="the dataset's, see docs/usage.md")] = None,
    clients: Annotated[int | None, Opt(help="Number of clients K.", show_default=_d('clients'))] = None,
    partition: Annotated[str | None, Opt(help="iid | dirichlet | longtail | shards | domains", show_default=_d('partition'))] = None,
    alpha: Annotated[float | None, Opt(help="Dirichlet concentration (smaller = more skew).", show_default=_d('alpha'))] = None,
    imbalance_factor: Annotated[float | None, Opt(help="Long-tail imbalance factor IF.", show_default=_d('imbalance_factor'))] = None,
    shards_per_client: Annotated[int | None, Opt(help="Shards per client (shards partition).", show_default=_d('shards_per_client'))] = None,
    rounds: Annotated[int | None, Opt(help="Communication rounds.", show_default=_d('rounds'))] = None,
    local_epochs: Annotated[int | None, Opt(help="Local epochs E.", show_default='per model, see docs/usage.md')] = None,
    batch_size: Annotated[int | None, Opt(help="Local batch size.", show_default='per model, see docs/usage.md')] = None,
    lr: Annotated[float | None, Opt(help="Local SGD learning rate.", show_default='per model, see docs/usage.md')] = None,
    momentum: Annotated[float | None, Opt(help="Local SGD momentum.", show_default='per model, see docs/usage.md')] = None,
    weight_decay: Annotated[float | None, Opt(help="Local SGD weight decay.", show_default='per model, see docs/usage.md')] = None,
    participation: Annotated[float | None, Opt(help="Fraction of clients per round.", show_default=_d('participation'))] = None,
    eval_every: Annotated[int | None, Opt(help="Evaluate every N rounds.", show_default=_d('eval_every'))] = None,
    seed: Annotated[int | None, Opt(help="Random seed.", show_default=_d('seed'))] = None,
    device: Annotated[str | None, Opt(help="auto | cpu | cuda", show_default=_d('device'))] = None,
    workers: Annotated[int | None, Opt(help="Worker processes for local training and calibration payloads.", show_default=_d('workers'))] = None,
    threads: Annotated[int | None, Opt(help="Torch threads per process.", show_default=_d('threads'))] = None,
    precision: Annotated[str | None, Opt(help="auto | fp32 | bf16: bf16 autocast on CUDA (auto: for models of 5M+ parameters).", show_default=_d('precision'))] = None,
    deterministic: Annotated[bool | None, Opt("--deterministic/--no-deterministic", help="Deterministic kernels: reproducible GPU runs (slower).", show_default=_d('deterministic'))] = None,
    augment: Annotated[bool | None, Opt("--augment/--no-augment", help="Random crop + flip.", show_default="the dataset's, see docs/usage.md")] = None,
    mu: Annotated[float | None, Opt(help="FedProx/clsprox/MOON/FedUV mu (method default if unset).", show_default=_d('mu'))] = None,
    tau: Annotated[float | None, Opt(help="MOON temperature.", show_default=_d('tau'))] = None,
    beta: Annotated[float | None, Opt(help="FedAvgM server momentum.", show_default=_d('beta'))] = None,
    server_lr: Annotated[float | None, Opt(help="FedAvgM server learning rate.", show_default=_d('server_lr'))] = None,
    lam: Annotated[float | None, Opt(help="FedUV variance weight lambda (default D/4).", show_default=_d('lam'))] = None,
    calibrate: Annotated[str | None, Opt(help="none | ccvr | creff | oracle | oracle:N", show_default=_d('calibrate'))] = None,
    virtual_per_class: Annotated[int | None, Opt(help="CCVR virtual features per class M.", show_default=_d('virtual_per_class'))] = None,
    virtual_mode: Annotated[str | None, Opt(help="CCVR M_c: balanced | proportional", show_default=_d('virtual_mode'))] = None,
    tukey: Annotated[bool | None, Opt("--tukey/--no-tukey", help="CCVR ReLU + Tukey transform.", show_default=_d('tukey'))] = None,
    features_per_class: Annotated[int | None, Opt(help="CReFF federated features per class m.", show_default=_d('features_per_class'))] = None,
    match_steps: Annotated[int | None, Opt(help="CReFF gradient-matching steps I.", show_default=_d('match_steps'))] = None,
    retrain_steps: Annotated[int | None, Opt(help="CReFF classifier re-training steps J.", show_default=_d('retrain_steps'))] = None,
    feature_lr: Annotated[float | None, Opt(help="CReFF federated-feature learning rate.", show_default=_d('feature_lr'))] = None,
    creff_weighting: Annotated[str | None, Opt(help="CReFF g_agg: client (paper) | sample", show_default=_d('creff_weighting'))] = None,
    dp_eps: Annotated[float | None, Opt(help="Total epsilon for the uploads (inf = off).", show_default=_d('dp_eps'))] = None,
    dp_delta: Annotated[float | None, Opt(help="DP delta (default below 1/N).", show_default=_d('dp_delta'))] = None,
    dp_clip: Annotated[float | None, Opt(help="Feature norm bound R.", show_default=_d('dp_clip'))] = None,
    dp_grad_clip: Annotated[float | None, Opt(help="Per-sample class-gradient norm bound.", show_default=_d('dp_grad_clip'))] = None,
    accountant: Annotated[str | None, Opt(help="rdp | prv", show_default=_d('accountant'))] = None,
    dp_train: Annotated[bool | None, Opt("--dp-train/--no-dp-train", help="DP-SGD local training.", show_default=_d('dp_train'))] = None,
    dp_train_share: Annotated[float | None, Opt(help="Budget share of DP-SGD.", show_default=_d('dp_train_share'))] = None,
    secagg: Annotated[bool | None, Opt("--secagg/--no-secagg", help="CKKS secure aggregation.", show_default=_d('secagg'))] = None,
    hide_counts: Annotated[bool | None, Opt("--hide-counts/--show-counts", help="Hide class counts.", show_default=_d('hide_counts'))] = None,
    secagg_updates: Annotated[bool | None, Opt("--secagg-updates/--no-secagg-updates", help="CKKS sums of model updates.", show_default=_d('secagg_updates'))] = None,
    insecure_seeded_noise: Annotated[bool | None, Opt("--insecure-seeded-noise", help="INSECURE: draw DP noise from the seed (tests only).")] = None,
    transcript: Annotated[bool | None, Opt("--transcript/--no-transcript", help="Record the server's view.", show_default=_d('transcript'))] = None,
    out: Annotated[Path | None, Opt(help="Run folder (default runs/<method>-<dataset>-<time>).")] = None,
    config: Annotated[Path | None, Opt(help="TOML file of settings, or a run's config.json (re-runs it); flags override it.")] = None,
    resume: Annotated[Path | None, Opt(help="Continue the run in this folder from its checkpoint (with --rounds N: extend it to N rounds).")] = None,
    report: Annotated[bool, Opt("--report/--no-report", help="Write RUN_DIR/report.html at the end (privfedcal report).")] = False,
    log: Annotated[str | None, Opt(help="Extra live log: tensorboard (needs the tensorboard extra).")] = None,
) -> None:
    """Train with a federated method (and a calibrator) and write a run folder."""
    flags = {k: v for k, v in locals().items() if k not in ("config", "resume", "report", "log")}
    from privfedcal.cli.run import execute, resume_run
    from privfedcal.federation.runlog import parse_log

    extras = {"log": parse_log(log), "report_html": report}

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
    flags["out"] = str(out) if out is not None else None
    cfg = resolve_config(config, flags)
    check_calibration_params(cfg)
    run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg)
    if (run_dir / "checkpoint").exists() or (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    execute(cfg.replace(out=str(run_dir)), run_dir, **extras)


def register(app: typer.Typer) -> None:
    app.command("train", cls=TrainCommand)(train)
