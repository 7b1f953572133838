"""Assemble a run from its settings: data, model, method, calibrator, uplink, simulator.

One set of factories for every front end: ``privfedcal train``/``attack``/``audit`` (cli/),
the privacy audit (attacks/reconstruction/leakage_sweep.py) and the Flower ServerApp (flower/server_app.py). It sits
above the calibrators, which it looks up by name, and below the CLI and Flower
(docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfedcal.errors import UsageError
from privfedcal.settings.messages import SettingError, SettingText
from privfedcal.settings.run_config import METHOD_ALIASES, RunConfig

if TYPE_CHECKING:
    from privfedcal.federation.setup import Experiment
    from privfedcal.federation.simulator import Simulator


def method_choices() -> list[str]:
    """Every name ``--method`` accepts: the registered methods and their shorthands."""
    from privfedcal.algorithms import ALGORITHMS

    return sorted(set(ALGORITHMS.names()) | set(METHOD_ALIASES))


def check_method(name: str) -> None:
    if name not in method_choices():
        raise UsageError(f"unknown method {name!r}; valid choices: {', '.join(method_choices())}")


def check_calibration_params(cfg: RunConfig) -> None:
    """Calibration options need a calibrator that takes them: anything else is refused,
    naming the valid options (a typo must not silently run with the default)."""
    import privfedcal.calibration  # noqa: F401  (registers the calibrators)
    from privfedcal.federation.hooks import CALIBRATORS

    check_calibrate_spec(cfg)
    given = sorted(k for k, v in cfg.calibration_params.items() if v is not None)
    if not given:
        return
    name = cfg.calibrator.partition(":")[0]
    if name == "none":
        raise SettingError("calibration option(s) {given} given but no calibrator runs: add "
                           "{calibrate} {choices} (or {method} ccvr | creff)",
                           given=SettingText.named(given, spec="name"),
                           choices=" | ".join(n for n in CALIBRATORS.names() if n != "none"))
    cls = CALIBRATORS.get(name)
    params = getattr(cls, "Params", None)
    fields = sorted(f.name for f in dataclasses.fields(params)) if params else []
    valid = set(fields) | {f"{name}_{f}" for f in fields}
    unknown = [k for k in given if k not in valid]
    if unknown:
        raise UsageError(f"calibrator {name!r} takes no {', '.join(unknown)}; its options: "
                         f"{', '.join(fields) or 'none'}")


def check_calibrate_spec(cfg: RunConfig) -> None:
    """``--calibrate name[:N]``: N is a whole number after the ':' and only for a calibrator
    that takes it (its ``arg_field``: CCVR's virtual features, CReFF's federated features,
    the oracle's real features per class); N and that option's own flag with another value
    would leave one of them silently unused: refused."""
    import privfedcal.calibration  # noqa: F401  (registers the calibrators)
    from privfedcal.federation.hooks import CALIBRATORS

    name, colon, arg = cfg.calibrator.partition(":")
    cls = CALIBRATORS.get(name)  # an unknown name: a UsageError listing the valid ones
    if not colon:
        return
    field = getattr(cls, "arg_field", None)
    if field is None:
        raise UsageError(f"calibrator {name!r} takes no ':N' argument")
    if not arg.isdigit():
        raise SettingError("{calibrate=!r}: the argument after ':' must be an integer",
                           calibrate=cfg.calibrator)
    for key in (field, f"{name}_{field}"):
        value = cfg.calibration_params.get(key)
        if value is not None and value != int(arg):
            raise SettingError(f"{{calibrate}} {cfg.calibrator} sets {field.replace('_', '-')} "
                             f"to {int(arg)} but --{key.replace('_', '-')} {value} was given "
                             "too: give one of them")


def calibrator_class(cfg: RunConfig):
    """The registered class of the calibrator ``cfg.calibrator`` names: its ``releases`` and
    ``protectable`` are what the privacy planner protects."""
    import privfedcal.calibration  # noqa: F401  (registers the calibrators)
    from privfedcal.federation.hooks import CALIBRATORS

    return CALIBRATORS.get(cfg.calibrator.partition(":")[0])


def calibration_choice(cfg: RunConfig) -> tuple[Any, dict[str, Any]]:
    """``--calibrate`` (``name`` or ``name:N``) parsed, and the calibrator's options with the
    defaults that depend on the run's protection filled in: from the settings alone, so the
    top of a run decides them before the experiment is built."""
    from privfedcal.federation.hooks import CalibrationSpec
    from privfedcal.settings.floors import PrivacyOptions

    name, _, arg = cfg.calibrator.partition(":")
    if arg and not arg.isdigit():
        raise SettingError("{calibrate=!r}: the argument after ':' must be an integer",
                           calibrate=cfg.calibrator)
    spec = CalibrationSpec(name=name, arg=int(arg) if arg else None)
    # the calibrator's privacy policy reads the run's privacy options, not the whole config
    given = {**cfg.calibration_params, "seed": cfg.training.seed}
    options = calibrator_class(cfg).privacy_options(PrivacyOptions.of(cfg), given)
    return spec, options


def make_calibrator(choice: tuple[Any, dict[str, Any]], exp: Any):
    """The calibrator of ``choice`` (``calibration_choice``) for ``exp``'s classes and
    features."""
    from privfedcal.calibration import create_calibrator

    spec, options = choice
    return create_calibrator(spec, num_classes=exp.data.num_classes,
                             feature_dim=exp.model.feature_dim, options=options)


def build_calibrator(cfg: RunConfig, exp: Any):
    """The calibrator ``cfg.calibrator`` names (``name`` or ``name:N``), with its options."""
    return make_calibrator(calibration_choice(cfg), exp)


def build_experiment(cfg: RunConfig) -> Experiment:
    """The clients' (and the experimenter's) experiment of ``cfg``: the data, and the
    partition drawn from the data seed (``setup.resolve_data_seed``: ``--data-seed``, else
    secret under a protection, else ``--seed``; ``config_of(exp).data_seed`` holds it)."""
    from privfedcal.federation import setup
    from privfedcal.settings.floors import DataOptions, PrivacyOptions

    setup.start(cfg.engine)
    cfg = cfg.replace(data_seed=setup.resolve_data_seed(DataOptions.of(cfg),
                                                        PrivacyOptions.of(cfg)))
    data_options = DataOptions.of(cfg)
    data = setup.load_data(data_options)
    parts_np, counts, held = setup.draw_partition(data, data_options)
    return _assemble(cfg, data, parts_np, counts, held)


def build_server_experiment(cfg: RunConfig) -> Experiment:
    """The server's experiment (Flower ServerApp, attacks on a server view): model, method
    and test set, no partition (``parts`` and ``counts`` are None) and no training samples;
    ``num_examples`` is the public ``held_examples``. The data seed is neither read nor
    drawn. The dataset is read once for its test split and public metadata, and its
    training split is dropped before anything else runs."""
    from privfedcal.federation import setup
    from privfedcal.settings.floors import DataOptions

    setup.start(cfg.engine)
    data_options = DataOptions.of(cfg)
    data = setup.load_data(data_options)
    held = setup.held_examples(data.y_train.numpy(), data_options)
    return _assemble(cfg, setup.server_dataset(data), None, None, held)


def _assemble(cfg: RunConfig, data: Any, parts_np: Any, counts: Any, held: int) -> Experiment:
    """``cfg``'s settings left None resolved for the dataset and its model, the narrow
    options built from them once, and the experiment assembled from those."""
    from privfedcal.data.datasets import default_model_for
    from privfedcal.federation.setup import assemble
    from privfedcal.settings.floors import run_options
    from privfedcal.settings.run_config import resolve_training_defaults

    cfg = resolve_training_defaults(cfg, model=default_model_for(data), augment=data.augment)
    return assemble(run_options(cfg), data, parts_np, counts, held, record=cfg.to_dict())


def config_of(exp: Experiment) -> RunConfig:
    """The resolved settings of ``exp`` as a ``RunConfig`` (what ``config.json`` records),
    for the layers that speak in settings: the attacks, the analyses, the front ends."""
    return RunConfig.from_dict(exp.record)


def build_parts(cfg: RunConfig, *, server: bool = False) -> tuple[Any, Any, Any]:
    """The experiment (holding the resolved settings), its calibrator and its uplink;
    ``server``: the server's experiment (no training data, no partition: the Flower
    ServerApp's, ``build_server_experiment``)."""
    from privfedcal.privacy.executor import execute_plan, training_spec
    from privfedcal.privacy.planner import plan_for_run

    check_method(cfg.method)
    check_calibration_params(cfg)
    choice = calibration_choice(cfg)  # settings only: decided before the data are loaded
    exp = build_server_experiment(cfg) if server else build_experiment(cfg)
    calibrator = make_calibrator(choice, exp)
    plan = plan_for_run(exp.privacy, calibrator, exp.num_examples)  # pure: reads the options
    exp.spec = training_spec(exp.spec, plan)  # DP-SGD's schedule, under --dp-train
    return exp, calibrator, execute_plan(plan)


def build_simulator(cfg: RunConfig, run_dir: Path) -> Simulator:
    """The in-process ``Simulator`` of ``cfg``; it writes ``config.json`` into ``run_dir``."""
    from privfedcal.federation.simulator import Simulator

    exp, calibrator, uplink = build_parts(cfg)
    return Simulator(exp, run_dir, calibrator=calibrator, uplink=uplink)
