"""privfedcal's Python API: run experiments, read their results, attack what the server saw,
and use CCVR's calibration with its protection from a federated loop of one's own.

Every name here is re-exported by ``privfedcal`` (``privfedcal.__all__``); ``docs/api.md``
is the guide, with doctested examples. The functions run the same code as the CLI
(``privfedcal train`` / ``attack``) and write the same run folders; errors a user can fix
raise ``privfedcal.UsageError`` with one line (the CLI prints it and exits 2), which names
the keyword (``dp_eps``) where the CLI's names the flag (``--dp-eps``). Numbers may be
numpy scalars wherever Python numbers are taken.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import numpy as np
import torch
from torch import Tensor

from privfedcal.config import RunConfig
from privfedcal.errors import Diverged, PrivacyBudgetError, UsageError

if TYPE_CHECKING:
    from privfedcal.attacks.progress import Progress
    from privfedcal.models.base import FeatureClassifier

__all__ = [
    "Run", "RunConfig", "UsageError", "attack", "calibrate_head", "ccvr_statistics",
    "load_run", "privatize_statistics", "resume", "resume_simulator", "train",
]


# ---- the Python surface ------------------------------------------------------------------------
# The library's checks are shared with the CLI and name its flags (``--dp-eps``). Each public
# function here is wrapped by ``_python_surface``: its arguments become plain Python values
# (numpy and 0-d torch scalars included, checked against the parameter's annotation), and an
# error it raises names keywords instead of flags (``dp_eps``), translated through one table
# derived from the settings' descriptions (privfedcal/settings.py) and the attack options, so
# that a new setting is translated without a line here (tests/package/test_api_errors.py).

P = ParamSpec("P")
R = TypeVar("R")

#: a flag in a message: ``--dp-eps``, ``--no-transcript`` (not the ``--`` of a range), or a
#: flag's name alone as a message lists several (``virtual-per-class``: only a name with a
#: hyphen, which prose does not use)
_FLAG = re.compile(r"(?<![\w-])(?:--)?[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
#: a flag's value in a message: a number, or a placeholder (N, DIR)
_VALUE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?(?:e[-+]?\d+)?|inf|nan)|[A-Z]+")
_KIND_WORDS = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


@dataclass(frozen=True)
class Keyword:
    """What a flag is in Python: the keyword, its type and, for a boolean flag, the value
    the flag sets (``--show-counts`` is ``hide_counts=False``)."""

    name: str
    type: type
    value: bool | None = None


@functools.cache
def flag_keywords() -> dict[str, Keyword]:
    """Every flag of ``privfedcal train``'s settings and of ``privfedcal attack``'s options
    (``AttackOptions`` fields), by its spelling: ``--dp-eps`` is ``dp_eps``."""
    from privfedcal.attacks.runner import AttackOptions
    from privfedcal.descriptions import _kind
    from privfedcal.settings import cli_settings

    table: dict[str, Keyword] = {}
    hints = typing.get_type_hints(AttackOptions)
    for f in dataclasses.fields(AttackOptions):
        kind, flag = _kind(hints[f.name])[0], "--" + f.name.replace("_", "-")
        table[flag] = Keyword(f.name, kind, True if kind is bool else None)
        if kind is bool:
            table["--no-" + flag[2:]] = Keyword(f.name, bool, False)
    for s in cli_settings():  # a setting's spelling wins over an attack option's
        if s.type is bool:
            on, _, off = (s.param_decls or (s.flag_name,))[0].partition("/")
            table[on] = Keyword(s.name, bool, True)
            if off:
                table[off] = Keyword(s.name, bool, False)
        else:
            table[s.flag_name] = Keyword(s.name, s.type)
    return table


def _named_values(name: str) -> set[str]:
    """The values a string setting takes, by name (choices or its registry), so that a
    message's ``--method ccvr`` reads ``method='ccvr'``."""
    from privfedcal.data.datasets import DATASETS
    from privfedcal.experiment import method_choices
    from privfedcal.federation.hooks import CALIBRATORS
    from privfedcal.models import MODELS
    from privfedcal.settings import all_settings

    registries: dict[str, Callable[[], Iterable[str]]] = {
        "method": method_choices, "calibrate": lambda: [*CALIBRATORS.names(), "none"],
        "dataset": lambda: DATASETS, "model": MODELS.names}
    choices = next((s.choices for s in all_settings() if s.name == name and s.choices), None)
    return set(choices or (registries[name]() if name in registries else ()))


def python_message(text: str) -> str:
    """``text`` with each flag of ``flag_keywords`` as its keyword, and a value that follows
    the flag joined to it: ``--dp-eps must be`` -> ``dp_eps must be``,
    ``--secagg-min-clients 2`` -> ``secagg_min_clients=2``, ``--secagg`` -> ``secagg=True``,
    ``--method fedavg`` -> ``method='fedavg'``; a name alone (``match-steps``) is its keyword
    (``match_steps``). Other flags are left as they are."""
    table = flag_keywords()
    out, pos = [], 0
    for m in _FLAG.finditer(text):
        flag = m.group()
        bare = not flag.startswith("--")
        kw = table.get("--" + flag if bare else flag)
        if kw is None or (bare and "-" not in flag):
            continue
        out.append(text[pos:m.start()])
        pos = m.end()
        if bare or kw.type is bool:
            out.append(kw.name if bare else f"{kw.name}={kw.value}")
            continue
        after = re.match(r" ('[^']*'|[^\s,;()]+)", text[pos:])
        token = after.group(1).rstrip(":.") if after else ""
        if text[pos + 1 + len(token):].startswith(" |"):  # a list of choices, not a value
            token = ""
        if kw.type is str and token and (token[0] == "'" or token.isupper()
                                         or token.split(":")[0] in _named_values(kw.name)):
            shown = token if token[0] == "'" or token.isupper() else repr(token)
            out.append(f"{kw.name}={shown}")
            pos += 1 + len(token)
        elif kw.type is not str and token and _VALUE.fullmatch(token):
            out.append(f"{kw.name}={token}")
            pos += 1 + len(token)
        else:
            out.append(kw.name)
    return "".join(out) + text[pos:]


def _plain(value: Any) -> Any:
    """A numpy scalar or a 0-d tensor as the Python value it holds."""
    if isinstance(value, np.generic) or (isinstance(value, Tensor) and value.ndim == 0):
        return value.item()
    return value


def _coerce(value: Any, kind: type | None, name: str, optional: bool = True) -> Any:
    """``value`` as a plain ``kind`` (int, float, bool or str; other kinds: only made
    plain). An int never from a bool or from a float with a fraction; None only where
    ``optional`` (a setting's None is judged by its own check)."""
    value = _plain(value)
    if value is None and optional or kind not in _KIND_WORDS:
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is bool or kind is str:
        ok = isinstance(value, kind)
    else:
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok:
        raise UsageError(f"{name} must be {_KIND_WORDS[kind]}, got {value!r}")
    return float(value) if kind is float else value


def _as_path(value: Any, name: str, optional: bool) -> Path | None:
    if value is None and optional:
        return None
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise UsageError(f"{name} must be a path (a str or a Path), got {value!r}")


def _as_ints(value: Any, name: str, optional: bool) -> list[int] | None:
    if value is None and optional:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise UsageError(f"{name} must be a list of integers, got {value!r}")
    return [_coerce(v, int, f"{name}[{i}]", False) for i, v in enumerate(value)]


def _is(test: Callable[[Any], bool], what: str) -> Callable[[Any, str, bool], Any]:
    def check(value: Any, name: str, optional: bool) -> Any:
        if (value is None and optional) or test(value):
            return value
        raise UsageError(f"{name} must be {what}, got {type(value).__name__}")
    return check


#: how each parameter annotation of a public function is checked (the annotation without
#: ``| None``); an annotation missing here fails at import, so none goes unchecked
_CHECKS: dict[str, Callable[[Any, str, bool], Any]] = {
    "int": lambda v, n, o: _coerce(v, int, n, o),
    "float": lambda v, n, o: _coerce(v, float, n, o),
    "str": lambda v, n, o: _coerce(v, str, n, o),
    "str | Path": _as_path,
    "Run | str | Path": lambda v, n, o: v if isinstance(v, Run) else _as_path(v, n, o),
    "Iterable[int]": _as_ints,
    "RunConfig | Mapping[str, Any] | str | Path": _is(
        lambda v: isinstance(v, (RunConfig, Mapping, str, os.PathLike)),
        "a RunConfig, a mapping of settings or a settings file"),
    "Callable[[dict[str, Any]], None]": _is(callable, "callable"),
    "Callable[[Progress], None]": _is(callable, "callable"),
    "Tensor": _is(lambda v: isinstance(v, Tensor), "a torch.Tensor (torch.from_numpy(a))"),
    "Mapping[str, Tensor]": _is(
        lambda v: isinstance(v, Mapping) and all(isinstance(t, Tensor) for t in v.values()),
        "a mapping of names to torch tensors"),
    "FeatureClassifier": _is(
        lambda v: isinstance(v, torch.nn.Module) and hasattr(v, "features")
        and hasattr(v, "classifier"), "a FeatureClassifier (features(x) and a classifier head)"),
}


def _speak_python(exc: BaseException) -> None:
    """Rewrite ``exc``'s message (and a divergence's hint) in keywords, in place."""
    if isinstance(exc, Diverged):
        exc.hint = python_message(exc.hint)
    exc.args = (python_message(str(exc)),)


def _python_surface(func: Callable[P, R]) -> Callable[P, R]:
    """``func`` as Python callers see it: arguments checked and made plain by their
    annotations (``_CHECKS``), a wrong call a ``UsageError``, and the message of a usage,
    budget or divergence error in keywords (``python_message``). The CLI calls the
    unwrapped functions (``_resume_simulator``), whose messages keep its flags."""
    sig = inspect.signature(func)
    checks = {name: (_CHECKS[str(p.annotation).removesuffix(" | None")],
                     str(p.annotation).endswith("| None"))
              for name, p in sig.parameters.items()
              if p.annotation is not p.empty and p.kind is not p.VAR_KEYWORD}

    @functools.wraps(func)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise UsageError(f"{func.__name__}(): {exc}") from None
        for name, (check, optional) in checks.items():
            if name in bound.arguments:
                bound.arguments[name] = check(bound.arguments[name], name, optional)
        try:
            return func(*bound.args, **bound.kwargs)
        except (UsageError, PrivacyBudgetError, Diverged) as exc:
            _speak_python(exc)
            raise
    return call


def _options(cls: type, given: Mapping[str, Any], what: str,
             taken: Iterable[str] = ()) -> dict[str, Any]:
    """``given`` checked as keyword arguments of the dataclass ``cls`` (less the names
    ``taken`` by the function itself): an unknown name is a UsageError listing the valid
    ones, each value plain and of its field's type."""
    from privfedcal.descriptions import _kind

    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in set(taken)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise UsageError(f"unknown {what} {', '.join(unknown)}; valid names: {', '.join(names)}")
    out = {}
    for k, v in given.items():
        kind, optional = _kind(hints[k])
        out[k] = _coerce(v, kind, k, optional)
    return out


# ---- runs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """A run folder (``privfedcal train``'s or ``train()``'s), read lazily.

    ``path`` is the folder; ``config`` its settings (the experimenter's, with the data seed);
    ``summary`` and ``metrics`` the files of the same names; ``server_view`` the folder an
    auditor is given (``RUN/server``: public config, transcript, summary)."""

    path: Path

    @property
    def config(self) -> RunConfig:
        from privfedcal.federation.runfolder import read_run_config

        return read_run_config(self.path)

    @property
    def summary(self) -> dict[str, Any]:
        file = self.path / "summary.json"
        if not file.is_file():
            raise UsageError(f"{self.path} has no summary.json: the run did not finish")
        return json.loads(file.read_text())

    @property
    def accuracy(self) -> float:
        """Test accuracy of the final (calibrated) model, a fraction."""
        return float(self.summary["accuracy"])

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One record per evaluated round (``metrics.jsonl``)."""
        file = self.path / "metrics.jsonl"
        if not file.is_file():
            return []
        return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]

    @property
    def server_view(self) -> Path:
        from privfedcal.federation.runfolder import server_dir

        return server_dir(self.path)

    @_python_surface
    def experiment(self, device: str = "cpu") -> Any:
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
        from privfedcal.report.run import build_run_report

        return Path(build_run_report(self.path))


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


def _check_writable(folder: Path) -> None:
    """``folder`` can be created or written into: a temporary folder is made (and removed)
    in its nearest existing ancestor, which must be a folder."""
    import tempfile

    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"cannot write to out {folder}: {probe} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(dir=probe))
    except OSError as exc:
        raise UsageError(f"cannot write to out {folder}: {probe}: {exc.strerror or exc}") from None


@_python_surface
def train(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
          out: str | Path | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None,
          **settings: Any) -> Run:
    """Train one federated experiment and return its run folder.

    ``config``: a ``RunConfig``, a mapping of settings, or a TOML file / ``config.json``;
    keyword ``settings`` (``RunConfig`` field names: ``method="ccvr"``, ``dp_eps=8``)
    override it, and so do method hyperparameters and calibrator options by name
    (``mu=0.01``, ``match_steps=50``: the CLI's flags, each the keyword of its flag's name).
    Numbers may be numpy scalars. ``out``: the run folder (default
    ``runs/<method>-<dataset>-<time>``); a folder that already holds a run, or one that
    cannot be written, is refused. ``progress`` is called with each round's
    record. Raises ``Diverged`` when the loss or model stops being finite (the folder keeps
    what was written), ``UsageError`` on bad settings, ``PrivacyBudgetError`` when the
    budget cannot be met."""
    from privfedcal.experiment import build_simulator

    cfg = _config(config, settings)
    run_dir = Path(out) if out is not None else (Path(cfg.out) if cfg.out else _default_dir(cfg))
    if (run_dir / "checkpoint").exists() or (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} already holds a run; resume it or pick another out")
    _check_writable(run_dir)  # before the data are loaded and the model built
    sim = build_simulator(cfg.replace(out=str(run_dir)), run_dir)
    sim.run(progress=progress)
    sim.log.close()
    return Run(run_dir)


def _default_dir(cfg: RunConfig) -> Path:
    import time

    return Path("runs") / f"{cfg.method}-{cfg.dataset.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"


@_python_surface
def resume_simulator(run_dir: str | Path, rounds: int | None = None,
                     threads: int | None = None) -> Any:
    """The simulator of an interrupted run restored from its checkpoint, or of a finished
    one extended to ``rounds``, ready to ``run()`` (see ``_resume_simulator``)."""
    return _resume_simulator(Path(run_dir), rounds, threads)


def _resume_simulator(run_dir: Path, rounds: int | None = None,
                      threads: int | None = None) -> Any:
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


@_python_surface
def resume(run: Run | str | Path, rounds: int | None = None,
           progress: Callable[[dict[str, Any]], None] | None = None) -> Run:
    """Continue an interrupted run, or extend a finished one to ``rounds`` (as
    ``privfedcal train --resume RUN --rounds N``; see ``resume_simulator``)."""
    path = run.path if isinstance(run, Run) else Path(run)
    sim = _resume_simulator(path, rounds=rounds)
    sim.run(progress=progress)
    sim.log.close()
    return Run(path)


@_python_surface
def load_run(path: str | Path) -> Run:
    """An existing run folder."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a run folder (no config.json)")
    return Run(path)


# ---- attacks ----------------------------------------------------------------------------------

#: ``stats`` and ``gradients`` are the attacks the calibrators' releases name
#: (``ReleaseSpec.attack``); ``updates`` (the uplink's model updates) and ``classes`` (class
#: sets from any calibration release) are not tied to one calibrator
ATTACK_KINDS = ("stats", "gradients", "updates", "classes")


@_python_surface
def attack(run: Run | str | Path, kind: str, *, steps: int | None = None, restarts: int = 4,
           clients: Iterable[int] | None = None, classes: Iterable[int] | None = None,
           seed: int = 0, device: str = "cpu",
           progress: Callable[[Progress], None] | None = None,
           **options: Any) -> list[dict[str, Any]]:
    """Attack what the server observed in ``run`` and return one record per attacked
    target (the rows of ``attack.json``; scored against the truth when the experimenter's
    side of the run folder is there, unscored on a server view alone).

    ``kind``: ``stats`` (invert CCVR statistics), ``gradients`` (invert CReFF class
    gradients), ``updates`` (invert model updates) or ``classes`` (infer each client's class
    set). ``steps`` caps each inversion (default: run to convergence, up to
    ``DEFAULT_MAX_STEPS``); other ``options`` are ``AttackOptions`` fields (``privfedcal
    attack``'s flags by their keyword names: ``raw_samples=0``, ``round=2``); an unknown one
    is a ``UsageError``. ``progress`` receives a ``privfedcal.attacks.progress.Progress``
    as the inversions run (``steps`` of ``total`` optimisation steps, ``targets`` of ``of``,
    ``eta`` in seconds), as ``privfedcal attack`` shows it. Nothing is written: ``privfedcal
    attack`` writes the files."""
    from privfedcal.attacks.feature_inversion import DEFAULT_MAX_STEPS
    from privfedcal.attacks.release_attacks import release_attack
    from privfedcal.attacks.runner import AttackOptions, execute
    from privfedcal.attacks.runner import load_run as load_view
    from privfedcal.attacks.uploads import infer_class_sets

    if kind not in ATTACK_KINDS:
        raise UsageError(f"attack kind must be one of {', '.join(ATTACK_KINDS)}, got {kind!r}")
    steps = DEFAULT_MAX_STEPS if steps is None else steps  # AttackOptions checks both
    path = run.path if isinstance(run, Run) else Path(run)
    options = _options(AttackOptions, options, "attack option(s)",
                       taken=("steps", "restarts", "seed", "progress"))
    opts = AttackOptions(steps=steps, restarts=restarts, seed=seed, **options)
    view = load_view(path, device=device)
    if kind == "classes":
        records, _ = infer_class_sets(view, opts)
        return records
    ids = None if clients is None else list(clients)
    cls = None if classes is None else list(classes)
    # the attack registered under that name (a calibrator's ReleaseSpec.attack); model
    # updates are the uplink's release, attacked beside CReFF's
    attack = release_attack("gradients" if kind == "updates" else kind)
    if attack.plan is None:  # a whole-run attack has no per-release plan
        raise UsageError(f"attack kind {kind!r} attacks the whole run, not one release")
    if kind == "updates":
        plan = attack.plan(view, opts, ids, cls, updates=True, gradients=False)
    else:
        plan = attack.plan(view, opts, ids, cls)
    if not plan.jobs:
        raise UsageError("nothing to attack" + (": " + "; ".join(plan.notes) if plan.notes else ""))
    return [r.record for r in execute(plan, lambda job: None, on_progress=progress)]


# ---- CCVR from a loop of one's own (e.g. a Flower Strategy) ------------------------------------

@_python_surface
def ccvr_statistics(model: FeatureClassifier, x: Tensor, y: Tensor, num_classes: int, *,
                    clip: float | None = None, batch_size: int = 1024) -> dict[str, Tensor]:
    """A client's CCVR upload: per-class ``count`` (C,), feature ``sum`` (C, d) and ``outer``
    sums of z z^T (C, d, d), float64, of the model's features of (x, y). ``clip`` bounds
    each feature's L2 norm (needed before ``privatize_statistics``). ``model`` must be a
    ``FeatureClassifier`` (``features(x)`` and a ``classifier`` head), as privfedcal's
    models are."""
    from privfedcal.calibration.ccvr import StatsTask
    from privfedcal.privacy.bound import NoBound
    from privfedcal.privacy.dp import L2Clip

    bound = NoBound() if clip is None else L2Clip({"feature": float(clip)})
    model.eval()
    return StatsTask(num_classes, batch_size=batch_size).compute(model, x, y, bound)


@_python_surface
def privatize_statistics(stats: Mapping[str, Tensor], *, epsilon: float, delta: float,
                         clip: float) -> dict[str, Tensor]:
    """``stats`` (one client's, or a sum over clients) with Gaussian noise for one
    (epsilon, delta)-DP release of sample-level neighbours, the features clipped to ``clip``
    (``ccvr_statistics(..., clip=clip)``): sensitivities 1, clip and clip^2 for count, sum
    and outer, the noise multiplier from opacus' RDP accountant, noise from OS entropy.
    Privatize each client's upload before it leaves the client (or a secure sum of them);
    the epsilon holds for this one release."""
    from privfedcal.calibration.ccvr import CCVR_RELEASE
    from privfedcal.privacy.accounting import ReleasePlan, plan_noise
    from privfedcal.privacy.dp import gaussian_mechanism, payload_sensitivities
    from privfedcal.privacy.noise import noise_generator

    if not (0 < epsilon and math.isfinite(epsilon)) or not 0 < delta < 1:
        raise UsageError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    if not (clip > 0 and math.isfinite(clip)):
        raise UsageError(f"clip must be a finite number > 0, got {clip}")
    (sigma,) = plan_noise(epsilon, delta, [ReleasePlan(CCVR_RELEASE, 1.0, 1)])
    sens = payload_sensitivities(stats.keys(), clip=clip, grad_clip=clip)
    return gaussian_mechanism(dict(stats), sens, sigma, noise_generator())


@_python_surface
def calibrate_head(model: FeatureClassifier, stats: Mapping[str, Tensor], *,
                   virtual_per_class: int = 2000, seed: int = 0,
                   **retrain: Any) -> FeatureClassifier:
    """CCVR's server step on the summed (and possibly noised) statistics of the clients:
    draw ``virtual_per_class`` features per present class from the class Gaussians and
    re-train ``model``'s classifier head on them, in place; returns ``model``. ``retrain``:
    ``RetrainParams`` fields (``lr``, ``steps``, ``epochs``, ``batch_size``, ...)."""
    from privfedcal.calibration.ccvr import sample_virtual_features, virtual_counts
    from privfedcal.calibration.retrain import RetrainParams, retrain_head_of, write_head
    from privfedcal.calibration.stats import ClassStats
    from privfedcal.privacy.stages import symmetrise_outer

    if virtual_per_class < 1:
        raise UsageError(f"virtual_per_class must be >= 1, got {virtual_per_class}")
    params = RetrainParams(**_options(RetrainParams, retrain, "re-training option(s)"))
    # as the protected CCVR does: noised outer sums are symmetrised, and the sampler floors
    # the eigenvalues of each class covariance (calibration/ccvr.py)
    cs = ClassStats.from_payload(symmetrise_outer(dict(stats)))
    g = torch.Generator().manual_seed(seed)
    z, labels = sample_virtual_features(cs, virtual_counts(cs.count.cpu(), virtual_per_class), g)
    state = model.state_dict()
    weight, bias = retrain_head_of(state, z, labels, params, g)
    model.load_state_dict(write_head(state, weight, bias))
    return model
