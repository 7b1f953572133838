"""privfedcal: federated learning with classifier calibration, hardened uploads and audits.

The public Python API (``docs/api.md``) is importable from here: ``privfedcal.train``,
``privfedcal.load_run``, ``privfedcal.attack``, ``privfedcal.RunConfig``, ... (``__all__``).
They live in ``privfedcal/api.py`` and are loaded on first use, so that ``import privfedcal``
stays cheap for the modules of the package that only need ``__version__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Run", "RunConfig", "UsageError", "__version__", "attack", "calibrate_head",
    "ccvr_statistics", "load_run", "privatize_statistics", "resume", "resume_simulator", "train",
]

if TYPE_CHECKING:  # the names as a type checker sees them
    from privfedcal.api import (  # noqa: F401
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


def __getattr__(name: str) -> Any:
    """PEP 562: the API's names, imported from ``privfedcal.api`` on first access."""
    if name in __all__:
        from privfedcal import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'privfedcal' has no attribute {name!r}")
