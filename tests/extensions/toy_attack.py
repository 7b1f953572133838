"""A toy attack in one file: its options type, its registration and its report section.

It targets the toy calibrator's release (``labels``: the label ``toy_calibrator.py``
declares) and inverts, for every client and class an upload
shows, the class's mean feature (the feature sums over the counts) into one image. Which
payload key holds the sums and which the counts it reads from the release's declaration
(the key of sensitivity ``R`` and the key of sensitivity ``1``), so it names no key itself.

How it is switched on: importing this module (``import toy_attack`` with
``tests/extensions`` on ``sys.path``, as test_extensions.py's child process does) runs the
``register`` call at the bottom, which adds the attack ``toy_attack`` to
``privfedcal.attacks.release_attacks``. From then on:

* ``privfedcal.attack(RUN, "toy_attack", steps=20, toy_samples=2)``: its records (the
  options are ``ToyAttackOptions``' fields);
* ``privfedcal attack invert --toy_attack RUN [--toy-samples N]``: the flag and the
  option come from the registry when the CLI runs; it writes ``RUN/attack-toy_attack/``;
* ``privfedcal audit dp --calibrate toy-moments ...``: the release's channel, from
  ``task``, ``clip`` and ``keep`` below;
* ``privfedcal report RUN``: its section (``section``) for ``RUN/attack-toy_attack``.

``release_attacks.unregister("toy_attack")`` takes it out again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.reconstruction.feature_targets import FeatureTarget
from privfedcal.attacks.reconstruction.runner import InversionOptions, Plan, inversion_job
from privfedcal.attacks.reconstruction.uploads import classes_to_attack, sources
from privfedcal.attacks.release_attacks import (
    ReleaseAttack,
    ReportTable,
    register,
    release_for,
)
from privfedcal.attacks.view import UploadedFeatures
from privfedcal.errors import UsageError

NAME = "toy_attack"
TARGET = "toy-class-mean"
#: the label of the release it targets (toy_calibrator.py's declaration)
TOY_RELEASE = "toy-moments"


@dataclasses.dataclass(frozen=True)
class ToyAttackOptions(InversionOptions):
    """The inversions' options, and how many of a client's classes to attack."""

    toy_samples: int = attack_option(2, "Classes of each client to attack (the first ones "
                                     "its upload shows).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.toy_samples < 1:
            raise UsageError(f"--toy-samples must be >= 1, got {self.toy_samples}")


def _keys() -> tuple[str, str]:
    """(the key of the feature sums, the key of the counts), from the declaration."""
    spec = release_for(NAME)
    sums = [k for k, s in spec.sensitivity.items() if s == "R"]
    counts = [k for k, s in spec.sensitivity.items() if s == "1"]
    return sums[0], counts[0]


def plan_toy(view: Any, opts: ToyAttackOptions, clients: Any = None, classes: Any = None
             ) -> Plan:
    """One class-mean inversion per attacked client and class."""
    label, (sums, counts) = release_for(NAME).label, _keys()
    plan, rel = Plan(attack_batch=opts.attack_batch), view.release(label, opts.round)
    clip = view.summary.get("privacy", {}).get("feature_clip")
    extractor = UploadedFeatures(view.model, None, None if clip is None else float(clip))
    for client, payload, seen in sources(view, rel, clients, plan, opts.default_clients):
        stds = view.noise_stds(label, list(payload))
        shown = classes_to_attack(view, client, payload, stds, classes, opts, plan,
                                                label=label)
        for c, inferred in shown[:opts.toy_samples]:
            n = max(1, int(round(float(payload[counts][c]))))
            truth = view.truth(client, c)
            base = {"target": TARGET, "client": client, "class": c, "n": n,
                    "round": rel.round, "view": seen, "dp": any(s > 0 for s in stds.values()),
                    "n_true": None if truth is None else int(truth.numel()),
                    "class_inferred": inferred}
            mean = (payload[sums][c] / n).float()
            plan.jobs.append(inversion_job(view, opts, rel.state,
                                           FeatureTarget.class_mean(mean, n), truth, base,
                                           c + 1000 * (client or 0), paired=False,
                                           extractor=extractor))
    return plan


def task(cfg: Any, exp: Any, calibrator: Any) -> Any:
    """The release's client task as a client runs it (for ``audit dp``'s channel)."""
    return release_for(NAME).task(exp.data.num_classes)


def keep(key: str, c: int) -> tuple:
    """The entries a canary feature on axis 0 of class c moves: its count, and the first
    coordinate of its class's feature sum."""
    sums, _ = _keys()
    return (slice(c, c + 1), slice(0, 1)) if key == sums else (slice(c, c + 1),)


def section(records: list[dict[str, Any]]) -> ReportTable:
    """The report's section: per attacked client, its classes and their mean PSNR."""
    rows: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        rows.setdefault(r["client"], []).append(r)
    return ReportTable(
        ("client", "classes", "mean PSNR (dB)"),
        [[client, len(rs), sum(r["psnr"] or 0.0 for r in rs) / len(rs)]
         for client, rs in rows.items()],
        numeric=(False, True, True),
        notes=("Toy attack: each attacked class's mean feature inverted into one image.",))


class ToyAttack(ReleaseAttack):
    """The toy attack on the toy calibrator's release."""

    name = NAME
    labels = (TOY_RELEASE,)
    clip = "feature"
    options = ToyAttackOptions
    targets = (TARGET,)
    summary = "Invert the toy release's class means (a toy attack)."
    plan = staticmethod(plan_toy)
    task = staticmethod(task)
    keep = staticmethod(keep)
    report = staticmethod(section)


register(ToyAttack())
