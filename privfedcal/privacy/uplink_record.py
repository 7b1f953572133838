"""What the uplink keeps of a run: its stages' state for resume, and the protection it gave
for ``summary.json``.

Pure functions of the stages (privacy/stages.py, privacy/update_stage.py), which ``Uplink``
(privacy/uplink.py) calls from ``state_dict``, ``load_state_dict`` and ``summary``. Each
stage keeps its own state under its name and describes itself; these functions only gather
the parts, refuse a checkpoint holding the state of a stage the run does not plan, and
compose the run's statement where no stage gives DP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from privfedcal.errors import UsageError
from privfedcal.privacy.noise import INSECURE_STATEMENT
from privfedcal.privacy.stages import NoiseStage, Stage
from privfedcal.privacy.update_stage import UpdateStage


def stage_states(stages: Sequence[Stage | UpdateStage]) -> dict[str, Any]:
    """Every stage's own state by its name (stages without state left out); two stages of
    one name holding state could not be told apart on resume."""
    states: dict[str, Any] = {}
    for stage in stages:
        state = stage.state_dict()
        if state:
            if stage.name in states:
                raise RuntimeError(f"two stages named {stage.name!r} hold state")
            states[stage.name] = state
    return states


def load_stage_states(state: dict[str, Any], stages: Sequence[Stage],
                      update_stages: Sequence[UpdateStage]) -> None:
    """Give each stage its state from a checkpoint's ``state``: by stage name, or where the
    checkpoint keeps it elsewhere, the noise stage's under ``dp`` (a checkpoint without
    ``stages``) and an update stage's at its own top-level key. A checkpoint holding the
    state of a stage the run does not plan is refused (``UsageError``): a run with other
    settings saved it."""
    states = dict(state.get("stages") or {})
    if "stages" not in state and state.get("dp") is not None:
        states = {NoiseStage.name: state["dp"]}  # saved when only the noise stage's was
    for stage in update_stages:  # a checkpoint keeping it at its own top-level key
        held = state.get(stage.top_level_key) if stage.top_level_key else None
        if held is not None and stage.name not in states:
            states[stage.name] = held
    every: list[Stage | UpdateStage] = [*stages, *update_stages]
    own = {stage.name: stage for stage in every}
    foreign = sorted(name for name, st in states.items() if st and name not in own)
    if foreign:
        raise UsageError(f"the checkpoint holds the state of stage(s) {', '.join(foreign)}, "
                         "which this run does not plan: resume with the run's own settings")
    for name, st in states.items():
        if st:
            own[name].load_state_dict(st)


def protection_summary(stages: Sequence[Stage], update_stages: Sequence[UpdateStage], *,
                       hide_counts: bool, hides_updates: bool,
                       seeded_noise: bool) -> dict[str, Any]:
    """The run's protection for ``summary.json``: each stage's own summary
    (``Stage.summary``), the update stages' in server order (a ``statement`` of theirs
    appended to the run's), and a plain statement where no stage gives DP; empty where no
    stage describes itself."""
    out: dict[str, Any] = {}
    for stage in stages:
        out.update(stage.summary())
    for update in reversed(update_stages):  # the wire's sum first
        part = dict(update.summary())
        extra = part.pop("statement", None)
        if extra is not None:
            out["statement"] = f"{out.get('statement', '')}. {extra}"
        out.update(part)
    if not out:
        return {}
    dp, encrypted = "epsilon_spent" in out, "secagg" in out
    if encrypted and not dp:
        out["statement"] = ("no differential privacy: the server saw only the sum "
                            "of the calibration uploads (CKKS secure aggregation); model "
                            "updates " + ("only as their CKKS sum" if hides_updates
                                          else "travel in the clear"))
        if hide_counts and not hides_updates:
            out["statement"] += (", averaged with uniform weights: no client size "
                                 "reaches the server")
    elif hides_updates and not dp:
        out["statement"] = ("no differential privacy: the server saw the model updates "
                            "only as their CKKS sum; calibration uploads in the clear")
    out["hide_counts"] = hide_counts
    out["noise_source"] = "seeded (insecure)" if seeded_noise else "os-entropy"
    if seeded_noise:
        out["insecure"] = INSECURE_STATEMENT
        out["statement"] = INSECURE_STATEMENT + ". " + out.get("statement", "")
    return out


__all__ = ["load_stage_states", "protection_summary", "stage_states"]
