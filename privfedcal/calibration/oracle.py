"""Oracle calibration: re-train the head on *real* training features (Luo et al. 2021, sec. 3.3
"Classifier Post-calibration with IID Samples", and Table 5 with 100/1000 samples per class).

An upper bound for CCVR, not a federated protocol: the server reads every client's raw
features. ``--calibrate oracle`` uses all training samples, ``oracle:N`` at most N per class.
Re-training is the same as CCVR's (from the global head, ``RetrainParams``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from privfedcal.calibration.retrain import PosthocCalibrator, RetrainParams, retrain_head_of
from privfedcal.errors import UsageError
from privfedcal.federation.hooks import ServerContext


@dataclass(frozen=True)
class OracleParams(RetrainParams):
    """``per_class``: real features per class (None = all training samples)."""

    per_class: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.per_class is not None and self.per_class < 1:
            raise UsageError(f"oracle samples per class must be >= 1, got {self.per_class}")


class Oracle(PosthocCalibrator):
    """Head re-trained on real features of the pooled training set (upper bound)."""

    name: ClassVar[str] = "oracle"
    Params: ClassVar[type] = OracleParams
    arg_field: ClassVar[str] = "per_class"
    #: no federated release: it reads pooled raw features, so no protection applies
    releases: ClassVar[tuple] = ()
    protectable: ClassVar[bool] = False

    def __init__(self, params: OracleParams | None = None, *, num_classes: int,
                 feature_dim: int | None = None) -> None:
        super().__init__(params if params is not None else OracleParams(),
                         num_classes=num_classes, feature_dim=feature_dim)

    def after_training(self, ctx: ServerContext) -> dict[str, Any]:
        p: OracleParams = self.params
        t0 = time.perf_counter()
        z, y = ctx.centralized_features(ctx.global_state, per_class=p.per_class)
        weight, bias = retrain_head_of(ctx.global_state, z.float(), y, p, ctx.generator)
        return self._install(ctx, weight, bias, {
            "per_class": p.per_class,
            "real_features": int(z.shape[0]),
            "retrain_steps": p.num_steps(int(z.shape[0])),
            "seconds": round(time.perf_counter() - t0, 4),
        })
