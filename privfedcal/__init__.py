"""privfedcal: federated learning with classifier calibration, hardened uploads and audits.

The public Python API (``docs/api.md``) is importable from here: ``privfedcal.train``,
``privfedcal.load_run``, ``privfedcal.attack``, ``privfedcal.compare``,
``privfedcal.RunConfig``, ... (``__all__``). They live in the package ``privfedcal/api/``:
``__init__.py`` (training and resuming runs), ``run.py`` (``Run``), ``attacking.py``
(``attack``), ``ownloop.py`` (CCVR's halves for a loop of one's own), and in
``privfedcal/jobs/`` (the other jobs of the CLI: compare, analyze, audit, audit_dp,
partition, write_report, and their progress record ``JobStep``). They are loaded on first
use, so that ``import privfedcal`` stays cheap for the modules of the package that only
need ``__version__``. The typed results are in ``privfedcal.results``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: each public name and the module that defines it
_HOMES: dict[str, str] = {
    **dict.fromkeys(("RunConfig", "UsageError", "calibrate_head", "ccvr_statistics",
                     "load_run", "privatize_statistics", "resume", "resume_simulator",
                     "train"), "privfedcal.api"),
    "Run": "privfedcal.api.run",
    "attack": "privfedcal.api.attacking",
    **dict.fromkeys(("Audit", "Comparison", "DPAudit", "JobStep", "Partition", "analyze",
                     "audit", "audit_dp", "compare", "partition", "write_report"),
                    "privfedcal.jobs"),
}

__all__ = ["__version__", *sorted(_HOMES)]

if TYPE_CHECKING:  # the names as a type checker sees them
    from privfedcal.api import (  # noqa: F401  (Run and attack: re-exported by api)
        Run,
        RunConfig,
        UsageError,
        attack,
        calibrate_head,
        ccvr_statistics,
        load_run,
        privatize_statistics,
        resume,
        resume_simulator,
        train,
    )
    from privfedcal.jobs import (  # noqa: F401
        Audit,
        Comparison,
        DPAudit,
        JobStep,
        Partition,
        analyze,
        audit,
        audit_dp,
        compare,
        partition,
        write_report,
    )


def __getattr__(name: str) -> Any:
    """PEP 562: the API's names, imported from their module on first access. ``Stage`` is a
    deprecated alias of ``JobStep`` (a ``DeprecationWarning``; not in ``__all__``), kept
    because docs/api.md named it; the pipeline's stages are ``privacy.stages.Stage``."""
    if name == "Stage":
        import warnings

        warnings.warn("privfedcal.Stage is deprecated: the jobs' progress record is "
                      "privfedcal.JobStep", DeprecationWarning, stacklevel=2)
        return __getattr__("JobStep")
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'privfedcal' has no attribute {name!r}")
