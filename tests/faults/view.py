"""What the server holds, read from a run's ``server/`` folder and nothing else: its config,
summary, transcript index, the released aggregates, and the files' modification times.

A server keeps whatever its folder ever held: ``snapshot`` reads the folder at one moment
(after a stopped process, after a resumed one), ``merge`` joins snapshots, so that a release
rewritten by a resumed run still counts once for each distinct value the server received.
Only JSON and safetensors are read (never pickle).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.numpy import load_file

SECURE_VIEWS = ("aggregate",)


@dataclass
class Release:
    """One value the server received for a (round, label): a decrypted aggregate with the
    clients whose ciphertexts entered it, or one client's plain upload."""

    round: int
    label: str
    view: str
    contributors: tuple[int, ...]
    digest: str
    counts: list[float] | None = None  # a per-class count vector in the aggregate, if any
    weight: float | None = None  # a plain upload's clear aggregation weight


@dataclass
class ServerView:
    """Everything the harness checks; ``releases`` may hold several values for one
    (round, label) when a resumed run made a release again."""

    config: dict[str, Any]
    summary: dict[str, Any] | None
    entries: list[dict[str, Any]]
    releases: list[Release] = field(default_factory=list)
    mtimes: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    #: the server's own settings kept outside config.json (a Flower run's run config:
    #: ``flower.round-timeout`` ...): public, so records may cite them
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def clients(self) -> int:
        return int(self.config["clients"])

    def privacy(self) -> dict[str, Any]:
        return (self.summary or {}).get("privacy") or {}


def _digest(arrays: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode())
        h.update(arrays[key].tobytes())
    return h.hexdigest()[:16]


def _count_vector(arrays: dict[str, Any]) -> list[float] | None:
    for key in ("count", "counts"):
        value = arrays.get(key)
        if value is not None and value.ndim == 1:
            return [float(x) for x in value]
    return None


def _arrays(transcript: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """An entry's tensors: the whole file it names, or, in a file of several records, those
    under its ``key`` (``<key>/<name>``, the prefix taken off)."""
    path = transcript / entry["file"]
    if not path.is_file():
        return {}
    arrays = load_file(str(path))
    if entry.get("key") is None:
        return arrays
    prefix = f"{entry['key']}/"
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _releases(entries: list[dict[str, Any]], transcript: Path) -> list[Release]:
    """Aggregates with the senders of the ciphertexts recorded before them for the same
    round and label, and plain uploads with their client."""
    senders: dict[tuple[int, str], list[int]] = {}
    out = []
    for e in entries:
        key = (int(e["round"]), str(e["label"]))
        if e["view"] == "ciphertext":
            senders.setdefault(key, []).append(int(e["client"]))
        elif e["view"] in ("aggregate", "plain-upload") and e.get("file"):
            arrays = _arrays(transcript, e)
            who = (tuple(sorted(set(senders.pop(key, [])))) if e["view"] == "aggregate"
                   else (int(e["client"]),))
            out.append(Release(key[0], key[1], e["view"], who, _digest(arrays) or e["file"],
                               _count_vector(arrays), e.get("weight")))
    return out


def snapshot(server: Path) -> ServerView:
    """The server's folder as it is now."""
    server = Path(server)
    config = json.loads((server / "config.json").read_text())
    summary_file = server / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    transcript = server / "transcript"
    index = transcript / "index.json"
    entries = json.loads(index.read_text()) if index.is_file() else []
    files = sorted(str(p.relative_to(server)) for p in server.rglob("*") if p.is_file())
    mtimes = {f: (server / f).stat().st_mtime_ns for f in files}
    return ServerView(config, summary, entries, _releases(entries, transcript), mtimes, files)


def merge(views: list[ServerView]) -> ServerView:
    """The last snapshot, with every distinct release of the earlier ones added (a value
    the server once received stays received). A value received again, bit for bit (a
    resumed run re-sending what it released before the stop), is one release: it tells the
    server nothing new."""
    last = views[-1]
    seen: set[tuple] = set()
    extra = []
    for view in [last, *views[:-1]]:
        for r in view.releases:
            key = (r.round, r.label, r.view, r.contributors, r.digest)
            if key not in seen:
                seen.add(key)
                extra.append(r)
    return ServerView(last.config, last.summary, last.entries, extra,
                      last.mtimes, last.files, last.settings)
