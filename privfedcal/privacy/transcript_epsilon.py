"""Each client's epsilon recomputed from what the server holds, beside the run's claim.

The run's accountant charges what the protocol asked for; an auditor holds only the
server's folder: the transcript (``server/transcript/``, what the server received) and the
public plan (``config.json``, from which the planner gives every release label's noise
multiplier, sample rate and steps). This module counts, for every client, the DP releases of
its data that the transcript holds and composes them with opacus' accountant
(``accounting.compute_epsilon``), sharing nothing with the run's accountant or ledgers. The
reported epsilon must be at least this one: a release the server holds twice with two
independent noise draws (a round redone after a stop with fresh noise) counts twice here.

What counts as one release of client k (label L, round r):
- in the clear: each distinct payload k uploaded for (r, L); the same tensors received
  again (a redone round re-sending its journaled release, privacy/release_journal.py) are
  worth nothing new and count once;
- under secure aggregation: each distinct decrypted sum of (r, L) that k's ciphertext
  entered (ciphertexts never decrypted on their own release nothing); a sum received again
  with the same tensors counts once;
- model updates (label ``model-update``): one DP-SGD release (its steps) under
  ``--dp-train`` and one DP-FedAvg release under ``--dp-updates``, each charged by the same
  rules.
An entry without its tensors (``--no-transcript``) cannot be compared: each attempt counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from privfedcal.privacy.accounting import compute_epsilon
from privfedcal.privacy.releases import DPSGD_RELEASE, UPDATE_RELEASE, USER_DP_RELEASE

#: tensors of a transcript entry, from its file and key (None: not on disk)
Loader = Callable[[Mapping[str, Any]], Mapping[str, torch.Tensor] | None]


@dataclass(frozen=True)
class PublicPlan:
    """What the public plan says of every DP release label: its noise multiplier, sample
    rate and steps per release, the run's delta and accountant."""

    sigmas: Mapping[str, float]
    rates: Mapping[str, float]
    steps: Mapping[str, int]
    delta: float
    accountant: str

    @classmethod
    def of(cls, dp: Any) -> PublicPlan:
        """The plan a ``DPAccounting`` was built from (its planned multipliers and rates,
        never its spend)."""
        return cls(dict(dp.sigmas), dict(dp.rates), dict(dp.steps), float(dp.delta),
                   dp.accountant.kind)

    def charged_as(self, label: str) -> list[str]:
        """The accountant labels a transcript label stands for (a model update: DP-SGD
        and/or DP-FedAvg; a calibration release: its own label)."""
        if label == UPDATE_RELEASE:
            return [x for x in (DPSGD_RELEASE, USER_DP_RELEASE) if x in self.sigmas]
        return [label] if label in self.sigmas and label != DPSGD_RELEASE else []


def _fingerprint(tensors: Mapping[str, torch.Tensor] | None, entry: Mapping[str, Any]) -> str:
    """What tells two received values apart: a hash of the entry's tensors, or (no tensors
    to compare) the entry's attempt, so that each attempt counts."""
    if tensors is None:
        return f"attempt-{int(entry.get('attempt', 0))}"
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        h.update(key.encode())
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _stage_labels(plan: PublicPlan, label: str,
                  tensors: Mapping[str, torch.Tensor] | None) -> list[str]:
    """A release recorded under one label for several planned stages (the plugin's clip
    search: ``quantile`` holding ``stage1`` or ``stage2``): the stage's own label, read
    from its tensors' key; every stage where the tensors are not on record."""
    stages = [x for x in plan.sigmas if x.startswith(label + "/")]
    if tensors is None:
        return stages
    named = {f"{label}/{k.removeprefix('stage')}" for k in tensors}
    return [x for x in stages if x in named]


@dataclass
class _Held:
    """Every release entry the server holds, under (client, label, round): values are
    compared (their tensors read and hashed) only where a key holds more than one."""

    plan: PublicPlan
    load: Loader | None
    entries: dict[tuple[int, str, int], list[Mapping[str, Any]]]
    received: int = 0  # release entries received, repeats included
    known: dict[str, str] = field(default_factory=dict)  # file#key -> fingerprint

    def _tensors(self, e: Mapping[str, Any]) -> Mapping[str, torch.Tensor] | None:
        return self.load(e) if self.load is not None and e.get("file") else None

    def add(self, clients: list[int], e: Mapping[str, Any]) -> None:
        labels = self.plan.charged_as(str(e["label"]))
        if not labels and any(x.startswith(f"{e['label']}/") for x in self.plan.sigmas):
            labels = _stage_labels(self.plan, str(e["label"]), self._tensors(e))
        if not labels or not clients:
            return
        self.received += 1
        for client in clients:
            for label in labels:
                self.entries.setdefault((client, label, int(e["round"])), []).append(e)

    def distinct(self, key: tuple[int, str, int]) -> set[str]:
        """The distinct values held under ``key``."""
        entries = self.entries[key]
        if len(entries) == 1:
            return {self.value(entries[0])}
        return {self.value(e) for e in entries}

    def value(self, e: Mapping[str, Any]) -> str:
        """The fingerprint of ``e``'s value, its tensors read once."""
        name = f"{e['file']}#{e.get('key')}" if e.get("file") else None
        if name and name in self.known:
            return self.known[name]
        value = _fingerprint(self._tensors(e), e)
        if name:
            self.known[name] = value
        return value


def held_releases(entries: Iterable[Mapping[str, Any]], plan: PublicPlan,
                  load: Loader | None = None) -> dict[int, dict[str, int]]:
    """client -> accountant label -> how many distinct releases of it the server holds."""
    return _count(_collect(entries, plan, load))


def _collect(entries: Iterable[Mapping[str, Any]], plan: PublicPlan,
             load: Loader | None) -> _Held:
    """Every release entry's value, under the clients whose data it holds."""
    held = _Held(plan, load, {})
    senders: dict[tuple[int, str, int], list[int]] = {}  # (round, label, attempt) -> k
    for e in entries:
        key = (int(e["round"]), str(e["label"]), int(e.get("attempt", 0)))
        if e["view"] == "plain-upload" and e.get("client") is not None:
            held.add([int(e["client"])], e)
        elif e["view"] == "ciphertext":
            senders.setdefault(key, []).append(int(e["client"]))
        elif e["view"] == "aggregate":
            held.add(senders.pop(key, []), e)
    return held


def _count(held: _Held) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for key in held.entries:
        counts = out.setdefault(key[0], {})
        counts[key[1]] = counts.get(key[1], 0) + len(held.distinct(key))
    return out


def transcript_epsilons(entries: Iterable[Mapping[str, Any]], plan: PublicPlan,
                        load: Loader | None = None) -> dict[str, Any]:
    """Each client's epsilon from the releases the server holds (``held_releases``),
    composed by opacus at the plan's noise: the worst (``epsilon``), every client's, the
    distinct releases held, and how many were received again with the same value
    (``repeated``: worth nothing new)."""
    held = _collect(entries, plan, load)
    counts = _count(held)
    per_client: dict[str, float] = {}
    known: dict[tuple, float] = {}
    for client, made in sorted(counts.items()):
        history = tuple(sorted((plan.sigmas[label], plan.rates[label],
                                plan.steps.get(label, 1) * n) for label, n in made.items()))
        if history not in known:
            known[history] = compute_epsilon(list(history), plan.accountant, plan.delta)
        per_client[str(client)] = known[history]
    repeated = {id(e) for key, entries in held.entries.items() if len(entries) > 1
                for e in entries}
    # entries received again with a value already held (a redone round's re-sent release)
    extra = len(repeated) - len({(held.value(e), e["round"]) for entries in
                                 held.entries.values() for e in entries if id(e) in repeated})
    return {"epsilon": max(per_client.values(), default=0.0), "per_client": per_client,
            "releases": sum(sum(c.values()) for c in counts.values()), "repeated": extra}


def file_loader(directory: Path | None) -> Loader | None:
    """Reads an entry's tensors from a transcript folder (safetensors only, either layout:
    privacy/transcript_files.py)."""
    if directory is None:
        return None
    from privfedcal.privacy.transcript_files import read_entry

    def load(entry: Mapping[str, Any]) -> Mapping[str, torch.Tensor] | None:
        return read_entry(Path(directory), entry)

    return load


__all__ = ["PublicPlan", "file_loader", "held_releases", "transcript_epsilons"]
