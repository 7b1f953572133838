"""What DP-FedAvg reports: its user-level epsilon and its block of ``summary.json``.

Pure functions of the values the DP-FedAvg stage (privacy/user_dp.py ``UserDP.summary``)
holds at the end of a run: the worst-off client's epsilon from the per-client accountants
(``worst_user_epsilon``) and the ``user_dp`` entry with its statement (``user_dp_summary``),
which says against whom the guarantee holds: with central noise not against the server,
which receives each clipped update; with distributed noise against every party but a key
holder colluding with the server.
"""

from __future__ import annotations

from typing import Any

from privfedcal.privacy.accounting import compute_epsilon

#: what the user-level guarantee assumes (summary.json, docs/threat-model.md)
USER_DP_ASSUMPTIONS = [
    "user level: neighbouring federations differ in one client's whole data, present or "
    "absent (zero-out adjacency; replace-one doubles the sensitivity)",
    "no amplification by client sampling: the selection comes from the public seed, so each "
    "round a client takes part in is a full Gaussian release (q = 1)",
    "the average divides by the public number of clients asked per round, never by a count "
    "or size that depends on the data",
    "central noise: the server is trusted with the clipped updates; distributed noise "
    "(--secagg-updates): the key holder does not collude with the server",
    "noise drawn from OS entropy (no --insecure-seeded-noise)",
]


def worst_user_epsilon(per_client: dict[int, Any], label: str) -> float:
    """The largest epsilon any client (``per_client``: client -> its accountant) has spent
    on the releases labelled ``label`` alone. Clients with the same history of releases have
    the same epsilon: it is computed once per distinct history (thousands of clients share
    a few)."""
    worst = 0.0
    known: dict[tuple, float] = {}
    for client, acc in per_client.items():
        if client < 0:
            continue
        history = tuple((z, q, t) for z, q, t, lab in acc.state_dict()["history"]
                        if lab == label)
        if history:
            key = (acc.kind, acc.delta, history)
            if key not in known:
                known[key] = compute_epsilon(list(history), acc.kind, acc.delta)
            worst = max(worst, known[key])
    return worst


def user_dp_summary(*, eps: float, delta: float, noise_multiplier: float, clip: float,
                    clip_words: str, std: float, denominator: int, distributed: bool,
                    adaptive: dict[str, Any] | None) -> dict[str, Any]:
    """DP-FedAvg's entries in the run's summary: its ``statement`` and its ``user_dp``
    block (``clip_words``: the clip as the statement words it; ``adaptive``: the clip
    policy's entry, None with a fixed clip)."""
    where = ("distributed: each of the round's n clients adds 1/(n-1) of the variance before CKKS "
             "encryption, the server sees only the noisy sum" if distributed else
             "central: the server adds it to the sum of the clipped updates it received")
    against = ("every party but a key holder colluding with the server" if distributed
               else "anyone who sees the global models, NOT the server (it receives each "
               "clipped update: add --secagg-updates to hide them)")
    statement = (f"model updates: ({eps:.3f}, {delta:.2g})-DP at user level "
                 f"(one client's whole data) for the worst-off client, DP-FedAvg with "
                 f"{clip_words}, noise multiplier "
                 f"{noise_multiplier:.4g}, {where}; holds against {against}; no "
                 "amplification by client sampling")
    return {"statement": statement, "user_dp": {"epsilon_spent": eps, "delta": delta,
                        "noise_multiplier": noise_multiplier,
                        "update_clip": clip, "noise_std_of_sum": std,
                        "denominator": denominator, "sample_rate": 1.0,
                        "noise": "distributed" if distributed else "central",
                        "adaptive_clip": adaptive,
                        "assumptions": USER_DP_ASSUMPTIONS, "statement": statement}}


__all__ = ["USER_DP_ASSUMPTIONS", "user_dp_summary", "worst_user_epsilon"]
