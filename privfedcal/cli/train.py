"""``privfedcal train``: run one federated experiment into a run folder (and ``--resume`` it)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from privfedcal.config import METHOD_ALIASES, RunConfig, load_toml
from privfedcal.errors import UsageError

Opt = typer.Option

#: CLI flag -> method hyperparameter (Params field); None values keep the method's default
METHOD_FLAGS = ("mu", "tau", "beta", "server_lr", "lam")
#: CLI flag -> calibrator option
CALIBRATION_FLAGS = ("virtual_per_class", "virtual_mode", "tukey", "features_per_class",
                     "match_steps", "retrain_steps", "feature_lr", "creff_weighting")


def method_choices() -> list[str]:
    from privfedcal.algorithms import ALGORITHMS

    return sorted(set(ALGORITHMS.names()) | set(METHOD_ALIASES))


def check_method(name: str) -> None:
    if name not in method_choices():
        raise UsageError(f"unknown method {name!r}; valid choices: {', '.join(method_choices())}")


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


def versions() -> dict[str, str]:
    import numpy
    import torch

    import privfedcal

    return {"privfedcal": privfedcal.__version__, "torch": torch.__version__,
            "numpy": numpy.__version__, "python": platform.python_version()}


def train(
    method: Annotated[str | None, Opt(help="Local method or shorthand (ccvr, creff).")] = None,
    dataset: Annotated[str | None, Opt(help="digits | cifar10 | cifar100 | stl10 | imagefolder:PATH | npz:PATH")] = None,
    data_root: Annotated[str | None, Opt(help="Folder holding the dataset files.")] = None,
    download: Annotated[bool | None, Opt("--download/--no-download", help="Download if missing (needs network).")] = None,
    model: Annotated[str | None, Opt(help="Model (default: the dataset's).")] = None,
    clients: Annotated[int | None, Opt(help="Number of clients K.")] = None,
    partition: Annotated[str | None, Opt(help="iid | dirichlet | longtail | shards | domains")] = None,
    alpha: Annotated[float | None, Opt(help="Dirichlet concentration (smaller = more skew).")] = None,
    imbalance_factor: Annotated[float | None, Opt(help="Long-tail imbalance factor IF.")] = None,
    shards_per_client: Annotated[int | None, Opt(help="Shards per client (shards partition).")] = None,
    rounds: Annotated[int | None, Opt(help="Communication rounds.")] = None,
    local_epochs: Annotated[int | None, Opt(help="Local epochs E.")] = None,
    batch_size: Annotated[int | None, Opt(help="Local batch size.")] = None,
    lr: Annotated[float | None, Opt(help="Local SGD learning rate.")] = None,
    momentum: Annotated[float | None, Opt(help="Local SGD momentum.")] = None,
    weight_decay: Annotated[float | None, Opt(help="Local SGD weight decay.")] = None,
    participation: Annotated[float | None, Opt(help="Fraction of clients per round.")] = None,
    eval_every: Annotated[int | None, Opt(help="Evaluate every N rounds.")] = None,
    seed: Annotated[int | None, Opt(help="Random seed.")] = None,
    device: Annotated[str | None, Opt(help="auto | cpu | cuda")] = None,
    workers: Annotated[int | None, Opt(help="Worker processes for local training (CPU).")] = None,
    threads: Annotated[int | None, Opt(help="Torch threads per process.")] = None,
    augment: Annotated[bool | None, Opt("--augment/--no-augment", help="Random crop + flip.")] = None,
    mu: Annotated[float | None, Opt(help="FedProx/clsprox/MOON/FedUV mu (method default if unset).")] = None,
    tau: Annotated[float | None, Opt(help="MOON temperature.")] = None,
    beta: Annotated[float | None, Opt(help="FedAvgM server momentum.")] = None,
    server_lr: Annotated[float | None, Opt(help="FedAvgM server learning rate.")] = None,
    lam: Annotated[float | None, Opt(help="FedUV variance weight lambda (default D/4).")] = None,
    calibrate: Annotated[str | None, Opt(help="none | ccvr | creff | oracle | oracle:N")] = None,
    virtual_per_class: Annotated[int | None, Opt(help="CCVR virtual features per class M.")] = None,
    virtual_mode: Annotated[str | None, Opt(help="CCVR M_c: balanced | proportional")] = None,
    tukey: Annotated[bool | None, Opt("--tukey/--no-tukey", help="CCVR ReLU + Tukey transform.")] = None,
    features_per_class: Annotated[int | None, Opt(help="CReFF federated features per class m.")] = None,
    match_steps: Annotated[int | None, Opt(help="CReFF gradient-matching steps I.")] = None,
    retrain_steps: Annotated[int | None, Opt(help="CReFF classifier re-training steps J.")] = None,
    feature_lr: Annotated[float | None, Opt(help="CReFF federated-feature learning rate.")] = None,
    creff_weighting: Annotated[str | None, Opt(help="CReFF g_agg: client (paper) | sample")] = None,
    dp_eps: Annotated[float | None, Opt(help="Total epsilon for the uploads (inf = off).")] = None,
    dp_delta: Annotated[float | None, Opt(help="DP delta (default below 1/N).")] = None,
    dp_clip: Annotated[float | None, Opt(help="Feature norm bound R.")] = None,
    dp_grad_clip: Annotated[float | None, Opt(help="Per-sample class-gradient norm bound.")] = None,
    accountant: Annotated[str | None, Opt(help="rdp | prv")] = None,
    dp_train: Annotated[bool | None, Opt("--dp-train/--no-dp-train", help="DP-SGD local training.")] = None,
    dp_train_share: Annotated[float | None, Opt(help="Budget share of DP-SGD.")] = None,
    secagg: Annotated[bool | None, Opt("--secagg/--no-secagg", help="CKKS secure aggregation.")] = None,
    hide_counts: Annotated[bool | None, Opt("--hide-counts/--show-counts", help="Hide class counts.")] = None,
    transcript: Annotated[bool | None, Opt("--transcript/--no-transcript", help="Record the server's view.")] = None,
    out: Annotated[Path | None, Opt(help="Run folder (default runs/<method>-<dataset>-<time>).")] = None,
    config: Annotated[Path | None, Opt(help="TOML file of settings; flags override it.")] = None,
    resume: Annotated[Path | None, Opt(help="Continue the run in this folder from its checkpoint.")] = None,
    report: Annotated[bool, Opt("--report/--no-report", help="Write RUN_DIR/report.html at the end (privfedcal report).")] = False,
    log: Annotated[str | None, Opt(help="Extra live log: tensorboard (needs the tensorboard extra).")] = None,
) -> None:
    """Train with a federated method (and a calibrator) and write a run folder."""
    flags = {k: v for k, v in locals().items() if k not in ("config", "resume", "report", "log")}
    from privfedcal.cli.run import execute, resume_run
    from privfedcal.federation.runlog import parse_log

    extras = {"log": parse_log(log), "report_html": report}
    if resume is not None:
        resume_run(resume, **extras)
        return
    flags["out"] = str(out) if out is not None else None
    cfg = resolve_config(config, flags)
    run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg)
    if (run_dir / "checkpoint").exists() or (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    cfg = cfg.replace(out=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**cfg.to_dict(), "versions": versions()},
                                                    indent=2))
    execute(cfg, run_dir, **extras)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
