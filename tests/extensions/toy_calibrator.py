"""A toy calibrator in one file: ``--calibrate toy-moments``, post-hoc logit adjustment.

Once after training every client uploads, per class, the sum of its clipped penultimate
features (``toy_moment``) and its number of examples (``toy_tally``); the server adds
``-strength * log(prior_c)`` to the classifier's bias, with the class prior from the summed
tallies (post-hoc logit adjustment, Menon et al., ICLR 2021), and reports the mean
feature norm per class from the summed moments.

Its one release is declared below and nowhere else: the payload keys, their sensitivities
and CKKS bounds and what they hold (the attack that targets it names its label in its own
file, tests/extensions/toy_attack.py). No file of the package names these keys or this label
(tests/extensions/test_extensions.py checks it), so the DP noise, secure aggregation, the
transcript, the attacker's noise model and the report all read this declaration.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.calibration.retrain import PosthocCalibrator, read_head
from privfedcal.errors import UsageError
from privfedcal.federation.hooks import CALIBRATORS, Bound, Payload, ServerContext
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.releases import ReleaseSpec

NAME = "toy-moments"
TOY_RELEASE = "toy-moments"
MOMENT, TALLY = "toy_moment", "toy_tally"


@dataclass(frozen=True)
class ToyTask:
    """A client's upload: per-class sums of its clipped features and its class counts."""

    num_classes: int

    def compute(self, model: FeatureClassifier, x: Tensor, y: Tensor, bound: Bound) -> Payload:
        with torch.no_grad():
            z = model.features(x).float()
        z = bound.clip(z, "feature")
        onehot = F.one_hot(y, self.num_classes).to(z.dtype)
        return {MOMENT: onehot.T @ z, TALLY: onehot.sum(0)}


TOY_SPEC = ReleaseSpec(
    TOY_RELEASE,
    sensitivity={MOMENT: "R", TALLY: "1"},     # one example: one row of norm <= R, one count
    magnitude={MOMENT: "R*N", TALLY: "N"},
    participants="all", task=ToyTask,
    holds={MOMENT: "per-class sums of clipped features (C, d)",
           TALLY: "per-class example counts (C,)"})


@dataclass(frozen=True)
class ToyParams:
    """``strength``: tau of the logit adjustment (0: the head is left as trained)."""

    strength: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.strength) and self.strength >= 0):
            raise UsageError(f"toy-moments strength must be a finite number >= 0, got "
                             f"{self.strength}")


@CALIBRATORS.register(NAME)
class ToyMoments(PosthocCalibrator):
    """Post-hoc logit adjustment from federated class counts."""

    name: ClassVar[str] = NAME
    Params: ClassVar[type] = ToyParams
    releases: ClassVar[tuple] = (TOY_SPEC,)

    def __init__(self, params: ToyParams | None = None, *, num_classes: int,
                 feature_dim: int | None = None) -> None:
        super().__init__(params if params is not None else ToyParams(),
                         num_classes=num_classes, feature_dim=feature_dim)

    def after_training(self, ctx: ServerContext) -> dict[str, Any]:
        t0 = time.perf_counter()
        total = ctx.collect(ToyTask(self.num_classes), list(range(ctx.num_clients)),
                            ctx.global_state, TOY_RELEASE)
        tally = total[TALLY].double().clamp_min(0)
        prior = (tally + 1) / (tally.sum() + self.num_classes)   # add-one: no class at 0
        head = read_head(ctx.global_state)
        bias = head.bias if head.bias is not None else torch.zeros(self.num_classes)
        shift = (self.params.strength * prior.log()).to(bias)
        norms = (total[MOMENT].double() / tally.clamp_min(1)[:, None]).norm(dim=1)
        return self._install(ctx, head.weight, bias - shift, {
            "seconds": round(time.perf_counter() - t0, 4), "retrain_steps": 0,
            "strength": self.params.strength,
            "mean_feature_norm": [round(float(v), 6) for v in norms],
        })
