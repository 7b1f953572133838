"""The epsilon of what a run's server holds, recomputed from its server folder alone.

An auditor given a run's ``server/`` folder (or a copy of it) rebuilds the public plan the
way every party does (the planner on ``config.json`` and the public dataset metadata, no
partition, no data seed) and counts the DP releases in ``transcript/``
(privacy/transcript_epsilon.py). ``privfedcal audit`` shows it beside the epsilon the run
reports: a claim below it means the server holds releases nobody charged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from privfedcal.errors import UsageError


def run_epsilon(run_dir: Path) -> dict[str, Any] | None:
    """``transcript_epsilons`` of the run at ``run_dir`` (a run folder or a server view),
    its plan rebuilt from the public config; None for a run without DP."""
    from privfedcal.experiment import build_parts
    from privfedcal.federation.runfolder import TRANSCRIPT_DIR, server_view
    from privfedcal.privacy.transcript_epsilon import (
        PublicPlan,
        file_loader,
        transcript_epsilons,
    )
    from privfedcal.settings.run_config import read_run_config

    view = server_view(Path(run_dir))
    cfg = read_run_config(view)
    if not (cfg.privacy.dp_enabled or cfg.privacy.dp_train or cfg.privacy.dp_updates):
        return None
    index = view / TRANSCRIPT_DIR / "index.json"
    if not index.is_file():
        raise UsageError(f"{run_dir} has no transcript (trained with --no-transcript?): "
                         "the releases the server holds cannot be counted")
    _exp, _calibrator, uplink = build_parts(cfg.replace(device="cpu", workers=1),
                                            server=True)
    dp = uplink.accounting
    if dp is None:
        return None
    return transcript_epsilons(json.loads(index.read_text()), PublicPlan.of(dp),
                               file_loader(view / TRANSCRIPT_DIR))


__all__ = ["run_epsilon"]
