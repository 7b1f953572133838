"""Classifier calibration: CCVR (Luo et al. 2021), CReFF (Shang et al. 2022) and the oracle.

``create_calibrator`` is the one entry point for the CLI and the simulator: it turns a
``--calibrate name[:N]`` spec plus a flat dict of CLI values into a ``Calibrator``.

Options: a key is a field of the calibrator's parameter dataclass (``CCVRParams``,
``OracleParams``, ``CReFFParams``), optionally prefixed with the calibrator's name
(``ccvr_steps`` wins over ``steps``); ``None`` means "use the default"; keys that name no
field of this calibrator are ignored (the CLI passes one dict to every calibrator). The
spec's integer argument sets ``CCVRParams.virtual_per_class``, ``OracleParams.per_class`` or
``CReFFParams.features_per_class``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from privfedcal.calibration.ccvr import (
    CCVR,
    CCVRParams,
    StatsTask,
    sample_virtual_features,
    virtual_counts,
)
from privfedcal.calibration.creff import CReFF, CReFFParams, GradTask
from privfedcal.calibration.oracle import Oracle, OracleParams
from privfedcal.calibration.retrain import RetrainParams, retrain_classifier
from privfedcal.calibration.stats import ClassStats, merge_client_moments
from privfedcal.calibration.transforms import relu_tukey
from privfedcal.errors import UsageError
from privfedcal.federation.hooks import CALIBRATORS, CalibrationSpec, Calibrator
from privfedcal.settings.descriptions import (
    calibration_options,
    check_value,
    register_calibration_options,
)


def calibrator_params(cls: type[Calibrator], spec: CalibrationSpec, options: dict[str, Any]) -> Any:
    """The parameter dataclass of ``cls`` filled from ``options`` and ``spec.arg``."""
    params_cls = cls.Params  # type: ignore[attr-defined]
    flagged = {s.name: s for s in calibration_options(params_cls)}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(params_cls):
        for key in (f.name, f"{spec.name}_{f.name}"):   # the prefixed key is looked at last
            if options.get(key) is not None:
                # a flagged option's type, as a settings file's is checked (settings/run_config.py)
                values[f.name] = (check_value(flagged[key], options[key], "calibration_params.")
                                  if key in flagged else options[key])
    if spec.arg is not None:
        values[cls.arg_field] = spec.arg  # type: ignore[attr-defined]
    return params_cls(**values)


def create_calibrator(spec: CalibrationSpec, *, num_classes: int, feature_dim: int,
                      options: dict[str, Any] | None = None) -> Calibrator:
    """Build the calibrator named by ``spec``; unknown names raise a UsageError listing them."""
    cls = CALIBRATORS.get(spec.name)
    if not hasattr(cls, "Params"):
        if spec.arg is not None:
            raise UsageError(f"calibrator {spec.name!r} takes no ':N' argument")
        return cls()
    params = calibrator_params(cls, spec, options or {})
    with_params: Any = cls  # a calibrator with Params takes them and the head's shape
    return with_params(params, num_classes=num_classes, feature_dim=feature_dim)


# the options a registered calibrator's Params declare with a flag
# (descriptions.calibration_option) become settings
for _name, _cls in CALIBRATORS.items():
    if hasattr(_cls, "Params"):
        register_calibration_options(_cls.Params)

__all__ = [
    "CCVR", "CCVRParams", "CReFF", "CReFFParams", "ClassStats", "GradTask", "Oracle",
    "OracleParams", "RetrainParams", "StatsTask", "create_calibrator", "merge_client_moments",
    "relu_tukey", "retrain_classifier", "sample_virtual_features", "virtual_counts",
]
