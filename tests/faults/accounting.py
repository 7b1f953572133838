"""Invariant (b): every release the server holds is charged. Each client's epsilon is
recomputed from the releases in the server's folder and the run's public plan (each label's
noise multiplier, sample rate and planned steps, as summary.json publishes them), with
opacus' RDP accountant called directly, never through the package's accounting."""

from __future__ import annotations

from collections import Counter
from typing import Any

from opacus.accountants import RDPAccountant

from .invariants import Violation
from .view import ServerView

UPDATE = "model-update"
TOLERANCE = 1e-6  # relative: floating point between two RDP evaluations


def steps_per_release(label: str, plan: dict[str, Any], limits: dict[str, int]) -> float:
    """A release's accountant steps: DP-SGD runs the plan's steps spread evenly over the
    rounds a client may take part in; every other release is one Gaussian step."""
    if label == "dp-sgd":
        return float(plan["steps"]) / max(1, int(limits.get(label, 1)))
    return 1.0


def releases_of(view: ServerView, label: str) -> Counter[int]:
    """Per client, how many distinct values of ``label``'s releases the server holds (a
    release made again with fresh noise counts twice)."""
    wire = UPDATE if label in ("dp-sgd", "dp-fedavg") else label
    held: Counter[int] = Counter()
    for r in view.releases:
        if r.label == wire and r.view in ("aggregate", "plain-upload"):
            held.update(r.contributors)
    return held


def recomputed(view: ServerView) -> dict[int, float]:
    """Each client's epsilon over every release the server holds."""
    privacy = view.privacy()
    delta = float(privacy["delta"])
    limits = privacy.get("client_release_limits") or {}
    history: dict[int, list[tuple[float, float, int]]] = {}
    for plan in privacy.get("releases") or []:
        label = plan["label"]
        per = steps_per_release(label, plan, limits)
        for client, times in releases_of(view, label).items():
            steps = int(round(per * times))
            history.setdefault(client, []).append(
                (float(plan["noise_multiplier"]), float(plan["sample_rate"]), steps))
    out = {}
    for client, events in history.items():
        acc = RDPAccountant()
        acc.history = list(events)
        out[client] = float(acc.get_epsilon(delta))
    return out


def charged(view: ServerView) -> list[Violation]:
    """Reported epsilon >= recomputed for every client, and <= the target."""
    privacy = view.privacy()
    if "epsilon_spent" not in privacy:
        return []
    out = []
    target = float(privacy.get("epsilon_target") or float("inf"))
    reported = {int(k): float(v) for k, v in (privacy.get("per_client_epsilon") or {}).items()}
    spent = float(privacy["epsilon_spent"])
    if spent > target * (1 + TOLERANCE):
        out.append(Violation("charged", f"reported epsilon {spent:.4f} exceeds the target "
                             f"{target:g}"))
    for client, eps in sorted(recomputed(view).items()):
        claim = reported.get(client, spent)
        if eps > claim * (1 + TOLERANCE) + TOLERANCE:
            out.append(Violation("charged", f"client {client}: the releases the server holds "
                                 f"are worth epsilon {eps:.3f}, reported {claim:.3f}"))
        if eps > target * (1 + TOLERANCE):
            out.append(Violation("charged", f"client {client}: the releases the server holds "
                                 f"are worth epsilon {eps:.3f}, over the target {target:g}"))
    return out
