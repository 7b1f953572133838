"""Invariant (c), the records of ``server/``: a whitelist of its files and fields, written
here by hand (not read from the package's record types), checked on a ``ServerView``.

Each summary field is declared as ``public`` (any value: settings, the public plan, the
evaluation of the model on the public test set) or ``text`` (free text: every number in it
must be a public one, from config.json or a public field, or an integer no larger than the
run's client and round counts). A field not declared here is a violation: a new field
needs a line here saying why the server may hold it.
"""

from __future__ import annotations

import re
from typing import Any

from .invariants import Violation
from .view import ServerView

PUBLIC, TEXT = "public", "text"

#: summary.json: field path (list items as ``[]``) -> kind; a dict declared PUBLIC is
#: public as a whole
SUMMARY: dict[str, str] = {
    **{k: PUBLIC for k in (
        "method", "local_method", "calibrator", "dataset", "model", "rounds", "wall_seconds",
        "uploaded_bytes", "calibration_upload_bytes", "model_update_bytes", "accuracy",
        "loss", "per_class_accuracy", "accuracy_before_calibration",
        "per_class_accuracy_before_calibration", "calibration", "creff_dsa",
        "creff_client_draws", "creff_release_rounds", "plugin", "flower_holds",
        "last_finite_evaluation", "checkpoint_round")},
    "notes[]": TEXT,
    **{f"rejected_uploads[].{k}": PUBLIC for k in ("round", "label", "client")},
    "rejected_uploads[].reason": TEXT,
    # a skipped release's counts: the uploads the server received and the public minimum
    **{f"skipped_releases[].{k}": PUBLIC for k in ("round", "label", "uploads", "min_clients")},
    "skipped_releases[].reason": TEXT,
    **{f"dropped_clients[].{k}": PUBLIC for k in ("round", "label", "client", "node",
                                                  "message", "group")},
    "dropped_clients[].reason": TEXT,
    **{f"diverged.{k}": PUBLIC for k in ("round", "client")},
    **{f"diverged.{k}": TEXT for k in ("what", "hint")},
    **{f"privacy.{k}": PUBLIC for k in (
        "epsilon_spent", "epsilon_target", "delta", "accountant", "covers",
        "noise_multipliers", "sample_rates", "feature_clip", "grad_clip",
        "distributed_noise", "releases", "per_client_epsilon", "epsilon_clients",
        "client_release_limits", "secagg", "hide_counts", "noise_source", "whole_run",
        # recomputed from the transcript and the public plan: a function of the server's view
        "from_transcript")},
    **{f"privacy.{k}": TEXT for k in ("statement", "assumptions[]", "insecure")},
    **{f"privacy.secagg_updates.{k}": PUBLIC for k in (
        "scheme", "params", "min_clients", "keys", "release_rounding", "cohorts",
        "model_updates", "rounds", "mean_seconds_per_round")},
    **{f"privacy.user_dp.{k}": PUBLIC for k in (
        "epsilon_spent", "delta", "noise_multiplier", "update_clip", "noise_std_of_sum",
        "denominator", "sample_rate", "noise", "adaptive_clip")},
    **{f"privacy.user_dp.{k}": TEXT for k in ("statement", "assumptions[]")},
}

#: transcript/index.json entries: the fields an entry may carry
INDEX_FIELDS = {"round", "label", "view", "client", "participants", "weight", "bytes",
                "local_epochs", "batch_size", "lr", "file", "key", "clients",
                "attempt"}  # which try at a round after a resume: the server saw both
FILES = re.compile(r"^(config\.json|summary\.json|transcript/index\.json|"
                   r"transcript/\d{5}(-a\d+)?-r\d+-[a-z0-9-]+\.safetensors)$")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def walk(value: Any, path: str = ""):
    """(path, leaf) pairs of a JSON value; list items under ``[]``."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from walk(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v, f"{path}[]")
    else:
        yield path, value


def declared(path: str) -> str | None:
    """The kind of ``path``, or of the nearest enclosing field declared public."""
    probe = path
    while probe:
        if probe in SUMMARY:
            return SUMMARY[probe] if probe == path or SUMMARY[probe] == PUBLIC else None
        cut = max(probe.rfind("."), probe.rfind("[]"))
        probe = probe[:cut] if cut > 0 else ""
    return None


def public_numbers(view: ServerView) -> list[float]:
    values = [v for _, v in walk(view.config)] + [v for _, v in walk(view.settings)]
    values += [v for p, v in walk(view.summary or {}) if declared(p) == PUBLIC]
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def is_public(token: str, public: list[float], small: int) -> bool:
    x = float(token)
    if x == int(x) and abs(x) <= small:
        return True
    return any(abs(x - v) <= 5e-4 * max(abs(v), 1e-12) or abs(x - v) <= 10 ** -_decimals(token)
               for v in public)


def _decimals(token: str) -> int:
    if "e" in token.lower():
        return 99  # scientific: relative match only
    return len(token.split(".")[1]) if "." in token else 0


def records(view: ServerView) -> list[Violation]:
    """Undeclared files and fields, private numbers in text, a client named by a divergence
    under secure aggregation of the updates."""
    out = [Violation("records", f"undeclared file server/{f}") for f in view.files
           if not FILES.match(f)]
    public = public_numbers(view)
    small = max(int(view.config.get("clients", 0)), int(view.config.get("rounds", 0)))
    for path, leaf in walk(view.summary or {}):
        kind = declared(path)
        if kind is None:
            out.append(Violation("records", f"undeclared field summary.json:{path}"))
        elif kind == TEXT and isinstance(leaf, str):
            bad = [t for t in NUMBER.findall(leaf) if not is_public(t, public, small)]
            if bad:
                out.append(Violation("records", f"summary.json:{path} holds non-public "
                                     f"number(s) {bad}: {leaf!r}"))
    for e in view.entries:
        extra = sorted(set(e) - INDEX_FIELDS)
        if extra:
            out.append(Violation("records", f"undeclared index field(s) {extra}"))
    return out + divergence(view) + listed_rejections(view)


def divergence(view: ServerView) -> list[Violation]:
    """Under secure aggregation of the updates no record names the diverged client."""
    d = (view.summary or {}).get("diverged")
    if not d or not view.config.get("secagg_updates"):
        return []
    text = " ".join(str(v) for v in d.values() if isinstance(v, str))
    if d.get("client") is not None or re.search(r"\bclient \d+", text):
        return [Violation("records", f"a divergence under --secagg-updates names a client: "
                          f"{d}")]
    return []


def listed_rejections(view: ServerView) -> list[Violation]:
    """Every participant missing from a secure sum of its round (or from a skipped one) is
    listed: rejected, or its node dropped."""
    summary = view.summary or {}
    if not (view.config.get("secagg") or view.config.get("secagg_updates")):
        return []
    m = int(view.config.get("secagg_min_clients") or 2)
    participants = {int(e["round"]): set(e.get("participants") or []) for e in view.entries
                    if e["label"] == "round"}
    sent: dict[tuple[int, str], set[int]] = {}
    for e in view.entries:
        if e["view"] == "ciphertext":
            sent.setdefault((int(e["round"]), e["label"]), set()).add(int(e["client"]))
    attempted = {(int(e["round"]), e["label"]) for e in view.entries
                 if e["view"] == "aggregate"}
    attempted |= {(int(s["round"]), s["label"]) for s in summary.get("skipped_releases", [])}
    # a release skipped when it opened (fewer clients to ask than its minimum, counted in
    # the record's ``uploads``) saw no upload at all; one whose every upload was rejected
    # records 0 uploads, and its rejections must be listed
    before_upload = {(int(s["round"]), s["label"]) for s in summary.get("skipped_releases", [])
                     if int(s.get("uploads") or 0) > 0
                     and (int(s["round"]), s["label"]) not in sent}
    listed = {(int(x["round"]), x["label"], int(x["client"]))
              for x in summary.get("rejected_uploads", [])}
    dropped = {int(x["client"]): str(x.get("group", "")) for x in
               summary.get("dropped_clients", [])}
    out = []
    for round_, label in sorted(attempted):
        asked = participants.get(round_, set())
        if len(asked) < m or (round_, label) in before_upload:
            continue  # too few asked, or skipped before any upload: no upload to list
        for c in sorted(asked - sent.get((round_, label), set())):
            lost = c in dropped and str(round_) in dropped[c]
            if (round_, label, c) not in listed and not lost:
                out.append(Violation("records", f"round {round_} {label}: client {c}'s upload "
                                     "is missing from the sum and from rejected_uploads"))
    return out


def timing(view: ServerView) -> list[Violation]:
    """No per-client time in the folder: the per-client files of a round carry one time."""
    per_round: dict[str, set[int]] = {}
    for f, t in view.mtimes.items():
        m = re.match(r"transcript/\d{5}(?:-a\d+)?-r(\d+)-.*-c\d+\.safetensors$", f)
        if m:
            per_round.setdefault(m.group(1), set()).add(t)
    return [Violation("timing", f"round {r}: its per-client files carry {len(ts)} distinct "
                      "modification times") for r, ts in sorted(per_round.items()) if len(ts) > 1]
