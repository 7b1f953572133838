"""The attack on CCVR's class statistics (the release ``CCVR_RELEASE`` of
calibration/ccvr.py): ``attack invert --stats``, and the release's channel in ``audit dp``.

From each attacked upload (or the aggregate under secure aggregation) and each class it
shows: the class mean inverted as one image, the class mean and covariance as n images
(``FeatureTarget.class_stats``, up to ``--max-n``), and, with the clients' images at hand,
the raw-feature baseline (real images' features inverted one by one). Under DP the moments
come from the noisy sums (``noisy_stats_to_moments``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.reconstruction.feature_inversion import FeatureTarget
from privfedcal.attacks.reconstruction.runner import (
    InversionOptions,
    Plan,
    inversion_job,
    size_of,
)
from privfedcal.attacks.reconstruction.uploads import classes_to_attack, sources
from privfedcal.attacks.release_attacks import ReleaseAttack, release_for
from privfedcal.attacks.view import RunView, UploadedFeatures
from privfedcal.calibration.ccvr import CCVR_RELEASE
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError

NAME = "stats"


@dataclasses.dataclass(frozen=True)
class StatsOptions(InversionOptions):
    """``attack invert --stats``: the inversions' options and the raw-feature baseline."""

    raw_samples: int = attack_option(3, "Real images per client/class for the raw-feature "
                                     "baseline (0: none).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.raw_samples < 0:
            raise SettingError(f"{{raw_samples}} must be >= 0 (0: no baseline), got "
                             f"{self.raw_samples}")


def plan_stats(view: RunView, opts: StatsOptions, clients: Sequence[int] | None = None,
               classes: Sequence[int] | None = None) -> Plan:
    """Raw-feature baseline, class-mean and class-stats inversion of a CCVR release."""
    from privfedcal.calibration.stats import ClassStats
    from privfedcal.privacy.dp import noisy_stats_to_moments

    label = release_for(NAME).label
    plan, rel = Plan(attack_batch=opts.attack_batch), view.release(label, opts.round)
    extractor = uploaded_extractor(view)
    for client, payload, seen in sources(view, rel, clients, plan, opts.default_clients):
        stds = view.noise_stds(label, list(payload))
        noisy = any(s > 0 for s in stds.values())
        if noisy:
            count, mean, cov = noisy_stats_to_moments(payload["count"], payload["sum"],
                                                      payload["outer"])
        else:
            st = ClassStats.from_payload(dict(payload))
            count, mean, cov = st.count, st.mean(), st.covariance()
        for c, inferred in classes_to_attack(view, client, payload, stds, classes, opts, plan,
                                                label=label):
            truth = view.truth(client, c)
            n = max(1, int(round(float(count[c]))))
            base = {"client": client, "class": c, "round": rel.round, "view": seen,
                    "dp": noisy, "n_true": size_of(truth), "class_inferred": inferred}
            tag = c + 1000 * client
            agg_tag = c + 1000 * 999 if seen == "aggregate" else tag
            if opts.raw_samples and truth is None:
                plan.notes.append("no raw-feature baseline: it needs the clients' images (the "
                                  "experimenter's side of the run folder); attacks run unscored")
            elif opts.raw_samples and truth is not None:
                g = make_generator(opts.seed, tag, 0, 62)
                pick = truth[torch.randperm(truth.numel(), generator=g)[:opts.raw_samples]
                             .to(truth.device)]
                with torch.no_grad():
                    view.load_state(rel.sent_state)
                    z = extractor.features(view.truth_exp.data.x_train[pick]).detach()
                plan.jobs.append(inversion_job(
                    view, opts, rel.sent_state, FeatureTarget.raw(z), pick,
                    {**base, "target": "raw-feature", "n": 1, "view": "hypothetical",
                     "dp": False, "images": int(pick.numel())}, tag * 4, paired=True,
                    extractor=extractor))
            m = mean[c].float()
            plan.jobs.append(inversion_job(
                view, opts, rel.sent_state, FeatureTarget.class_mean(m, n), truth,
                {**base, "target": "class-mean", "n": n}, agg_tag * 4 + 1, paired=False,
                extractor=extractor, shared=plan.shared))
            if n > opts.max_n:
                plan.notes.append(f"class-stats of class {c} ({n} samples) skipped: above "
                                  f"--max-n {opts.max_n}")
                continue
            plan.jobs.append(inversion_job(
                view, opts, rel.sent_state, FeatureTarget.class_stats(n, m, cov[c].float()), truth,
                {**base, "target": "class-stats", "n": n}, agg_tag * 4 + 2, paired=False,
                extractor=extractor, shared=plan.shared))
    return plan


def uploaded_extractor(view: RunView) -> FeatureClassifier:
    """The extractor as the CCVR clients applied it (Tukey transform, DP clip)."""
    from privfedcal.calibration.ccvr import CCVRParams

    params = view.cfg.calibration_params
    lam = (params.get("tukey_lambda", CCVRParams.tukey_lambda)
           if params.get("tukey", CCVRParams.tukey) else None)
    clip = view.summary.get("privacy", {}).get("feature_clip")
    if lam is None and clip is None:
        return view.model
    return UploadedFeatures(view.model, lam, None if clip is None else float(clip))


def task(cfg, exp, calibrator):
    """CCVR's client task with the run's options (what its ``after_training`` asks for)."""
    from privfedcal.calibration.ccvr import StatsTask

    p = calibrator.params
    return StatsTask(exp.data.num_classes, p.tukey, p.tukey_lambda, p.feature_batch_size)


def keep(key: str, c: int) -> tuple:
    """The entries a canary feature on axis 0 of class c moves: its count, the first
    coordinate of its sum and the first diagonal entry of its outer product."""
    return {"count": (slice(c, c + 1),), "sum": (slice(c, c + 1), slice(0, 1)),
            "outer": (slice(c, c + 1), slice(0, 1), slice(0, 1))}[key]


class StatsAttack(ReleaseAttack):
    """The inversion of CCVR's class statistics."""

    name = NAME
    labels = (CCVR_RELEASE,)
    clip = "feature"
    canary_keys = ("sum", "outer")
    options = StatsOptions
    summary = "Invert CCVR class statistics (and means)."
    targets = ("raw-feature", "class-mean", "class-stats")
    plan = staticmethod(plan_stats)
    task = staticmethod(task)
    keep = staticmethod(keep)


#: the attack, as the registry finds it (``release_attacks.RELEASE_ATTACKS``)
ATTACK = StatsAttack()

__all__ = ["ATTACK", "NAME", "StatsAttack", "StatsOptions", "keep", "plan_stats", "task", "uploaded_extractor"]
