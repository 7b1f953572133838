"""privfedcal's Python API: run experiments, read their results, attack what the server saw,
and use CCVR's calibration with its protection from a federated loop of one's own.

Every name here is re-exported by ``privfedcal`` (``privfedcal.__all__``); ``docs/api.md``
is the guide, with doctested examples. The functions run the same code as the CLI
(``privfedcal train`` / ``attack``) and write the same run folders; errors a user can fix
raise ``privfedcal.UsageError`` (the CLI turns them into one line and exit 2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from privfedcal.config import RunConfig
from privfedcal.errors import UsageError

if TYPE_CHECKING:
    from privfedcal.models.base import FeatureClassifier

__all__ = [
    "Run", "RunConfig", "UsageError", "attack", "calibrate_head", "ccvr_statistics",
    "load_run", "privatize_statistics", "resume", "resume_simulator", "train",
]


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

    if isinstance(config, RunConfig):
        base = config.to_dict()
    elif isinstance(config, (str, Path)):
        base = load_toml(config)
    else:
        base = dict(config or {})
    cfg = RunConfig.from_dict({**base, **settings})
    check_method(cfg.method)
    check_calibration_params(cfg)
    return cfg


def train(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
          out: str | Path | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None,
          **settings: Any) -> Run:
    """Train one federated experiment and return its run folder.

    ``config``: a ``RunConfig``, a mapping of settings, or a TOML file / ``config.json``;
    keyword ``settings`` (``RunConfig`` field names: ``method="ccvr"``, ``dp_eps=8``)
    override it. ``out``: the run folder (default ``runs/<method>-<dataset>-<time>``); a
    folder that already holds a run is refused. ``progress`` is called with each round's
    record. Raises ``Diverged`` when the loss or model stops being finite (the folder keeps
    what was written), ``UsageError`` on bad settings, ``PrivacyBudgetError`` when the
    budget cannot be met."""
    from privfedcal.experiment import build_simulator

    cfg = _config(config, settings)
    run_dir = Path(out) if out is not None else (Path(cfg.out) if cfg.out else _default_dir(cfg))
    if (run_dir / "checkpoint").exists() or (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} already holds a run; resume it or pick another out")
    sim = build_simulator(cfg.replace(out=str(run_dir)), run_dir)
    sim.run(progress=progress)
    sim.log.close()
    return Run(run_dir)


def _default_dir(cfg: RunConfig) -> Path:
    import time

    return Path("runs") / f"{cfg.method}-{cfg.dataset.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"


def resume_simulator(run_dir: str | Path, rounds: int | None = None,
                     threads: int | None = None) -> Any:
    """The simulator of an interrupted run restored from its checkpoint, or of a finished
    one extended to ``rounds``, ready to ``run()`` (``privfedcal train --resume`` runs it).

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


def resume(run: Run | str | Path, rounds: int | None = None,
           progress: Callable[[dict[str, Any]], None] | None = None) -> Run:
    """Continue an interrupted run, or extend a finished one to ``rounds`` (as
    ``privfedcal train --resume RUN --rounds N``; see ``resume_simulator``)."""
    path = run.path if isinstance(run, Run) else Path(run)
    sim = resume_simulator(path, rounds=rounds)
    sim.run(progress=progress)
    sim.log.close()
    return Run(path)


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


def attack(run: Run | str | Path, kind: str, *, steps: int | None = None, restarts: int = 4,
           clients: Iterable[int] | None = None, classes: Iterable[int] | None = None,
           seed: int = 0, device: str = "cpu", **options: Any) -> list[dict[str, Any]]:
    """Attack what the server observed in ``run`` and return one record per attacked
    target (the rows of ``attack.json``; scored against the truth when the experimenter's
    side of the run folder is there, unscored on a server view alone).

    ``kind``: ``stats`` (invert CCVR statistics), ``gradients`` (invert CReFF class
    gradients), ``updates`` (invert model updates) or ``classes`` (infer each client's class
    set). ``steps`` caps each inversion (default: run to convergence, up to
    ``DEFAULT_MAX_STEPS``); other ``options`` are ``AttackOptions`` fields. Nothing is
    written: ``privfedcal attack`` writes the files."""
    from privfedcal.attacks.feature_inversion import DEFAULT_MAX_STEPS
    from privfedcal.attacks.release_attacks import release_attack
    from privfedcal.attacks.runner import AttackOptions, execute
    from privfedcal.attacks.runner import load_run as load_view
    from privfedcal.attacks.uploads import infer_class_sets

    if kind not in ATTACK_KINDS:
        raise UsageError(f"attack kind must be one of {', '.join(ATTACK_KINDS)}, got {kind!r}")
    steps = DEFAULT_MAX_STEPS if steps is None else steps
    if steps < 1 or restarts < 1:
        raise UsageError(f"steps and restarts must be >= 1, got {steps} and {restarts}")
    path = run.path if isinstance(run, Run) else Path(run)
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
    return [r.record for r in execute(plan, lambda job: None)]


# ---- CCVR from a loop of one's own (e.g. a Flower Strategy) ------------------------------------

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
    params = RetrainParams(**retrain)
    # as the protected CCVR does: noised outer sums are symmetrised, and the sampler floors
    # the eigenvalues of each class covariance (calibration/ccvr.py)
    cs = ClassStats.from_payload(symmetrise_outer(dict(stats)))
    g = torch.Generator().manual_seed(seed)
    z, labels = sample_virtual_features(cs, virtual_counts(cs.count.cpu(), virtual_per_class), g)
    state = model.state_dict()
    weight, bias = retrain_head_of(state, z, labels, params, g)
    model.load_state_dict(write_head(state, weight, bias))
    return model
