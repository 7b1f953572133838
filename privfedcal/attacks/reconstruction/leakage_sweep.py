"""Privacy audit: sweep protection settings, train, attack, and tabulate utility vs leakage.

For every (method, epsilon, secure aggregation) setting the audit trains a run through the
same code as ``privfedcal train`` (``experiment.build_simulator`` + ``Simulator.run``), then
attacks its transcript exactly as ``privfedcal attack`` would: class statistics for CCVR,
class gradients for CReFF (the raw-feature baseline is left out: it does not depend on the
protection), and class-set inference for both. The inversions assume the attacker knows
the attacked client's label set even where noise hides it (``known_classes``): an upper
bound on the attacker, so that every setting gets a PSNR. Inversions run to convergence
(cap ``steps``). One row per setting, worst case over individuals first (the best
reconstruction's PSNR, whether its nearest training image is its true one, the client /
class / target it came from, the data-free prior's best PSNR under the same rule), then
accuracy, the attacks' mean PSNR / SSIM / feature cosine over targets (plus the prior's
mean PSNR, the level of an attack that learnt nothing), class-inference accuracy, what the
attacks on the run as a whole find (``release_attacks.run_attacks``: disaggregation across
rounds, the most clients whose own value the secure sums determine and the finest group they
resolve; with ``participation`` below 1 the sums change between rounds), and the epsilon
actually spent. Settings the library refuses (a budget that cannot be met, a method
with no calibration upload to protect) are kept as rows with a note, never a crash.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfedcal.attacks.reconstruction.inversion_options import (  # noqa: F401  (re-exported)
    AUDIT_DEFAULTS,
    AUDIT_INVERSION_OPTIONS,
    InversionOptions,
    audit_flags,
)
from privfedcal.attacks.release_attacks import attacked_calibrators, audit_params
from privfedcal.attacks.transcript_audit import run_epsilon
from privfedcal.errors import PrivacyBudgetError, PrivfedcalError, UsageError
from privfedcal.report.style.plotstyle import colour, label_points, new_figure, save, styled
from privfedcal.settings.messages import SettingError

COLUMNS = ("method", "eps", "secagg", "accuracy", "psnr_max", "nearest_of_worst",
           "worst_client", "worst_class", "worst_target", "prior_psnr_max", "psnr", "ssim",
           "feature_cosine", "class_inference_accuracy", "disaggregated", "finest_group",
           "epsilon_spent", "epsilon_from_transcript", "prior_psnr",
           "nearest_is_true", "nearest_chance", "converged", "targets", "note")


def __getattr__(name: str) -> tuple[str, ...]:
    """``ATTACKED_CALIBRATORS``: the calibrators whose releases an attack targets (the labels
    each attack names), read from the registries when asked (PEP 562), so that one
    registered after this module's import is audited too."""
    if name == "ATTACKED_CALIBRATORS":
        return attacked_calibrators()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Setting:
    method: str
    eps: float
    secagg: bool

    @property
    def name(self) -> str:
        eps = "inf" if math.isinf(self.eps) else f"{self.eps:g}"
        return f"{self.method}-eps{eps}-secagg-{'on' if self.secagg else 'off'}"

    @property
    def unprotected(self) -> bool:
        return math.isinf(self.eps) and not self.secagg


_DEFAULT = {f.name: f.default for f in audit_flags()}


@dataclass(frozen=True)
class AuditConfig:
    """The grid and the size of every run / attack (defaults: digits, seconds per setting)."""

    eps: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, math.inf)
    secagg: tuple[bool, ...] = (False, True)
    methods: tuple[str, ...] = ("ccvr", "creff")
    dataset: str = "digits"
    clients: int = 5
    alpha: float = 0.3
    rounds: int = 5
    participation: float = 1.0
    local_epochs: int = 1
    # the inversion options (AUDIT_INVERSION_OPTIONS): step cap (inversions stop at
    # convergence), restarts, targets per batched inversion (runner.execute)
    steps: int = _DEFAULT["steps"]
    restarts: int = _DEFAULT["restarts"]
    attack_batch: int = _DEFAULT["attack_batch"]
    attack_clients: int = 1
    max_n: int = 256
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not (self.eps and self.secagg and self.methods):
            raise UsageError("the audit grid needs at least one eps, secagg and method value")
        if any(math.isnan(e) or e <= 0 for e in self.eps):
            raise SettingError("every {eps} must be > 0 (inf = no DP)")
        if self.rounds < 1:
            raise SettingError(f"the audit needs {{rounds}} >= 1, got {self.rounds}")
        # the inversion options are checked as the attacks check them
        InversionOptions(**{n: getattr(self, n) for n in AUDIT_INVERSION_OPTIONS})
        if self.attack_clients < 1:
            raise SettingError("{attack_clients} must be >= 1")
        if not 0 < self.participation <= 1:
            raise SettingError(f"{{participation}} must be in (0, 1], got {self.participation}")

    def settings(self) -> list[Setting]:
        return [Setting(m, e, s) for m in self.methods for s in self.secagg for e in self.eps]


def _mean(values: list[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def run_setting(setting: Setting, config: AuditConfig, out_dir: Path,
                on_job: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train and attack one setting; returns its row (``note`` says why a row is empty)."""
    from privfedcal.attacks.reconstruction.runner import load_run
    from privfedcal.attacks.reconstruction.scoring import write_records

    row: dict[str, Any] = {"method": setting.method, "eps": setting.eps,
                           "secagg": setting.secagg, "note": ""}
    run_dir = out_dir / "runs" / setting.name
    try:
        sim, summary = _train(setting, config, run_dir)
    except _Skipped as skip:
        return {**row, "note": str(skip)}
    privacy = summary.get("privacy", {})
    held = run_epsilon(run_dir)  # from the run's server folder alone, beside the claim
    row.update(accuracy=summary["accuracy"],
               epsilon_spent=privacy.get("epsilon_spent", math.inf),
               epsilon_from_transcript=math.inf if held is None else held["epsilon"])
    view = load_run(run_dir, exp=sim.exp)
    try:
        found = _attack(view, sim.calibrator, config, on_job)
    except UsageError as exc:  # e.g. every release was skipped: nothing to attack
        return {**row, "targets": 0, "note": f"not attacked: {exc}"}
    write_records(found.records + found.class_records + found.whole_records,
                  run_dir / "attack.json")
    return {**row, **_scores(found)}


class _Skipped(PrivfedcalError):
    """A setting the library refuses or that has nothing to attack (the row's note)."""


def _train(setting: Setting, config: AuditConfig, run_dir: Path) -> tuple[Any, dict[str, Any]]:
    """Train one setting as ``privfedcal train`` would: its simulator and summary; raises
    ``_Skipped`` where the method uploads no calibration payload or the library refuses."""
    from privfedcal.experiment import build_simulator
    from privfedcal.settings.run_config import RunConfig

    try:
        cfg = RunConfig.of(method=setting.method, dataset=config.dataset, clients=config.clients,
                        alpha=config.alpha, rounds=config.rounds,
                        participation=config.participation,
                        local_epochs=config.local_epochs, seed=config.seed,
                        device=config.device, threads=1, dp_eps=setting.eps,
                        secagg=setting.secagg, out=str(run_dir))
        if cfg.calibrator not in attacked_calibrators():
            raise _Skipped(f"skipped: {setting.method} uploads no calibration payload "
                           "(nothing to attack)")
        # the calibrator's server-side work cut to what its attacks need (ReleaseAttack)
        cfg = cfg.replace(calibration_params=audit_params(cfg.calibrator))
        sim = build_simulator(cfg, run_dir)  # writes config.json
        return sim, sim.run()
    except (UsageError, PrivacyBudgetError) as exc:
        raise _Skipped(f"skipped: {exc}") from None


@dataclass
class _Findings:
    """What the attacks found on one run."""

    records: list[dict[str, Any]]  # the inversions', one per target
    class_records: list[dict[str, Any]]  # class-set inference's
    whole_records: list[dict[str, Any]]  # the attacks on the run as a whole
    whole: dict[str, Any]  # the latter's audit columns
    notes: list[str]


def _attack(view: Any, calibrator: Any, config: AuditConfig,
            on_job: Callable[[str], None] | None) -> _Findings:
    """Every attack on the run's transcript ``view``: the attacks on each release the
    calibrator declares (one batched plan), class-set inference and the attacks on the run as
    a whole (release_attacks.py)."""
    from privfedcal.attacks.attack_options import options_from
    from privfedcal.attacks.reconstruction.runner import execute
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions, infer_class_sets
    from privfedcal.attacks.release_attacks import attacks_of, run_attacks

    # every attack's options type takes the settings it has of these
    values = dict(steps=config.steps, restarts=config.restarts, raw_samples=0,
                  attack_batch=config.attack_batch, max_n=config.max_n, seed=config.seed,
                  default_clients=config.attack_clients, known_classes=True)
    plan, *more = [attack.plan(view, options_from(attack.options, values))
                   for _, attack in attacks_of(calibrator) if attack.plan is not None]
    for other in more:
        plan.jobs += other.jobs
        plan.notes += other.notes
    results = execute(plan, (lambda job: on_job(job.description)) if on_job else None)
    class_records, class_notes = infer_class_sets(view, options_from(ClassesOptions, values))
    whole_records: list[dict[str, Any]] = []
    whole: dict[str, Any] = {}
    for attack in run_attacks():  # attacks on the run as a whole (disaggregation)
        if attack.run is None:
            continue  # run_attacks lists only those with a run
        found, _ = attack.run(view, options_from(attack.options, values))
        whole_records += found
        if attack.audit_columns is not None:
            whole.update(attack.audit_columns(found))
    return _Findings([r.record for r in results], class_records, whole_records, whole,
                     list(dict.fromkeys(plan.notes + class_notes)))


def _scores(found: _Findings) -> dict[str, Any]:
    """A row's columns from the attacks' findings: worst case first, then means."""
    from privfedcal.attacks.reconstruction.scoring import worst_case

    records = found.records
    return {
        **worst_case(records),
        "converged": f"{sum(bool(r.get('converged')) for r in records)}/{len(records)}",
        "psnr": _mean([r["psnr"] for r in records]),
        "ssim": _mean([r["ssim"] for r in records]),
        "feature_cosine": _mean([r["feature_cosine"] for r in records]),
        "class_inference_accuracy": _mean([r["accuracy"] for r in found.class_records]),
        **found.whole,
        "prior_psnr": _mean([r["prior_psnr"] for r in records]),
        "nearest_is_true": _mean([r["nearest_is_true"] for r in records]),
        "nearest_chance": _mean([r["nearest_chance"] for r in records]),
        "targets": len(records),
        "note": ("; ".join(found.notes) if found.notes
                 else "" if records else "no target to attack"),
    }


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            cells = {k: _cell(r.get(k)) for k in COLUMNS}
            # every row says something in every worst-case column: yes/no where a target was
            # scored, n/a where none was (the note says why)
            nn = r.get("nearest_of_worst")
            cells["nearest_of_worst"] = "n/a" if nn is None else ("yes" if nn else "no")
            writer.writerow(cells)
    return path


def _cell(value: Any) -> Any:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def plot_audit(rows: list[dict[str, Any]], path: Path) -> Path:
    """Accuracy vs attack success, one point per setting: the WORST case over individuals
    (the best reconstruction's PSNR, filled marker; its mean over targets as a small open
    marker on the same row) and class-inference accuracy. The unprotected baseline is a
    star, secure aggregation a square; the dashed line is the data-free prior's best PSNR
    under the same scoring rule (an attack left of it learnt nothing visual)."""
    done = [r for r in rows if "accuracy" in r]
    with styled():
        fig = new_figure(10, 4)
        axes = fig.subplots(1, 2, sharey=True)
        _draw_audit(axes, done)
        fig.suptitle("privacy audit, worst case over individuals (open marker: mean over "
                     "targets); star = unprotected, square = secure aggregation", fontsize=9)
        return save(fig, path, dpi=110)


def _draw_audit(axes, done: list[dict[str, Any]]) -> None:
    panels = ((axes[0], "psnr_max", "worst-case reconstruction PSNR (dB, best individual)"),
              (axes[1], "class_inference_accuracy", "class-inference accuracy"))
    for ax, key, label in panels:
        labels: list[tuple[float, float, str]] = []
        for i, method in enumerate(dict.fromkeys(r["method"] for r in done)):
            c = colour(i)
            for r in (r for r in done if r["method"] == method):
                if not math.isfinite(r.get(key, math.nan)):
                    continue  # trained but not attacked
                s = Setting(r["method"], r["eps"], r["secagg"])
                marker = "*" if s.unprotected else ("s" if r["secagg"] else "o")
                y = 100 * r["accuracy"]
                ax.scatter(r[key], y, marker=marker, color=c,
                           s=160 if s.unprotected else 40, zorder=3,
                           edgecolors="black" if s.unprotected else None)
                if key == "psnr_max" and math.isfinite(r.get("psnr", math.nan)):
                    ax.scatter(r["psnr"], y, marker=marker, facecolors="none",
                               edgecolors=c, s=25, zorder=2)
                    ax.plot([r["psnr"], r[key]], [y, y], color=c, lw=0.6, alpha=0.5)
                eps = "inf" if math.isinf(r["eps"]) else f"{r['eps']:g}"
                labels.append((r[key], y, f"{method} eps={eps}{' sa' if r['secagg'] else ''}"))
        ax.set_xlabel(label)
        ax.margins(x=0.12, y=0.08)  # room for labels at the edges
        label_points(ax, labels)
    prior = max([r["prior_psnr_max"] for r in done
                 if math.isfinite(r.get("prior_psnr_max", math.nan))], default=math.nan)
    if math.isfinite(prior):
        axes[0].axvline(prior, ls="--", color="grey", lw=1)
        axes[0].text(prior, axes[0].get_ylim()[0], " data-free prior (best)", fontsize=6,
                     color="grey", va="bottom")
    axes[0].set_ylabel("test accuracy (%)")
