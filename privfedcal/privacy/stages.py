"""The stages of the uplink: bound -> noise -> wire (in the clear, or CKKS-encrypted).

As pfl-research's postprocessors do, every stage has a client half, run in order on each
client's payload, and a server half, run in reverse order. The last stage is the wire: its
``deliver`` (the server's side of it) turns the list of uploads into their sum (a plain sum, or a homomorphic sum the
key holder decrypts) and then hands that sum to ``finish``, which runs the server halves of
the earlier stages in reverse, wherever the sum first exists in the clear (the server in
the clear, the key holder under encryption: the top-up noise it draws must stay secret from
the server). ``open`` runs on the server before any client computes (the budget check, the
release's keys), ``close`` after the release is made (the accountant records it).

To add a protection, subclass ``Stage`` (in its own file) and register it in
privacy/stage_registry.py's ``STAGES`` (``register_stage``): its name, the stages it comes
after, and how the run's plan sets it up. The planner (``privfedcal.privacy.planner``) names no
stage, and the calibrators never know which stages ran.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from privfedcal.errors import UploadRejected
from privfedcal.privacy.bound import Bound, NoBound, Payload
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.reasons import Reason
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.transcript import Transcript
from privfedcal.tensors import all_finite

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting

#: fewest valid uploads for which a securely aggregated release is made (one upload would
#: hand the "aggregate" of a single client to the server)
MIN_SECAGG_CLIENTS = 2


class ReleaseLog(Protocol):
    """Where stages report a dropped upload or a release that is not made (the Uplink)."""

    def reject(self, round_: int, label: str, client: int,
               reason: Reason | str | BaseException, detail: str = "") -> None:
        """Record a dropped upload by its code (privacy/reasons.py; an exception gives its
        own), ``detail`` to the log only."""
        ...

    def raise_skipped(self, round_: int, label: str, reason: Reason | str | BaseException,
                      detail: str = "", **public: int) -> None:
        """Record that the release is not made (its code and public numbers), then raise
        ``ReleaseSkipped``."""
        ...


@dataclass
class Release:
    """One release of one label in one round, as the stages see it."""

    label: str
    round_: int
    asked: list[int]  # clients asked for an upload (the accountant charges these)
    clients: list[int]  # clients whose uploads are expected to reach the wire
    example: Payload  # keys and shapes of every upload
    transcript: Transcript
    log: ReleaseLog
    client: int = -1  # the client whose half runs (client halves only)
    arrived: int = 0  # uploads in the sum (set by the wire's server half)
    hidden: bool = False  # the server saw only the sum (set by an encrypting wire)
    state: dict[str, Any] = field(default_factory=dict)  # per-release state of the stages

    def at(self, client: int) -> Release:
        """The same release, seen by ``client``'s half."""
        return Release(self.label, self.round_, self.asked, self.clients, self.example,
                       self.transcript, self.log, client, self.arrived, self.hidden,
                       self.state)


Finish = Callable[[Payload, Release], Payload]


class Stage(ABC):
    """One layer of the uplink: a client half and a server half (and optional hooks).

    ``name`` is its name in the stage registry (privacy/stage_registry.py) and the key of
    its state in a checkpoint (``state_dict``: whatever a resumed run needs to go on
    exactly, e.g. the accountants)."""

    name: str = "stage"

    def open(self, rel: Release) -> None:
        """Server, before any client computes its upload."""
        return None

    def admit(self, rel: Release) -> None:
        """Client ``rel.client``, before its halves run: refuse (``BudgetRefused``) a
        release it must not make."""
        return None

    @abstractmethod
    def client(self, payload: Any, rel: Release) -> Any:
        """Client ``rel.client``: this layer applied to its upload."""

    @abstractmethod
    def server(self, total: Payload, rel: Release) -> Payload:
        """Where the sum is in the clear: this layer undone or completed on the sum."""

    def close(self, rel: Release) -> None:
        """Server, after the release is made."""
        return None

    # run-level hooks: local DP-SGD training is a release too; weights; resume; summary
    def before_training(self, clients: list[int] | None) -> None:
        return None

    def after_training(self, clients: list[int] | None) -> None:
        return None

    @property
    def uniform_weights(self) -> bool:
        """Whether client sizes are private, so model updates are averaged uniformly."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """This stage's entries in the run's protection summary (``summary.json``); none by
        default."""
        return {}


class Wire(Stage):
    """The last stage: how uploads cross to the server and become their sum."""

    hides_uploads: bool = False  # whether the server sees only the sum

    @abstractmethod
    def deliver(self, uploads: Iterable[tuple[int, Any]], rel: Release,
                finish: Finish) -> Payload:
        """The server's sum of ``uploads`` (an iterable, possibly lazy: each upload is taken
        once), passed through ``finish`` where it is clear."""

    def server(self, total: Payload, rel: Release) -> Payload:
        return total


def payload_bytes(payload: Payload) -> int:
    return int(sum(v.numel() * v.element_size() for v in payload.values()))


def symmetrise(payload: Payload, keys: Iterable[str]) -> Payload:
    """Keep the upper triangle of each of ``keys`` present in ``payload`` (noise included)
    and mirror it: post-processing of the noisy release, so the guarantee is unchanged and
    the matrices stay symmetric. ``keys``: the release's ``ReleaseSpec.symmetric``."""
    out = dict(payload)
    for k in set(keys) & set(payload):
        o = payload[k]
        out[k] = torch.triu(o) + torch.triu(o, 1).transpose(-1, -2)
    return out


def validate_upload(payload: Payload, reference: Payload | None) -> None:
    """Reject malformed uploads: non-tensors, NaN/Inf, keys or shapes unlike the others."""
    if not isinstance(payload, dict):
        raise UploadRejected("not a payload of tensors (a ciphertext where none was due?)")
    for k, v in payload.items():
        if not isinstance(v, torch.Tensor):
            raise UploadRejected(f"{k!r} is not a tensor")
        if not all_finite(v):
            raise UploadRejected(f"{k!r} contains NaN or Inf")
    if reference is not None:
        if set(payload) != set(reference):
            raise UploadRejected(f"keys {sorted(payload)} differ from {sorted(reference)}")
        for k, v in payload.items():
            if v.shape != reference[k].shape:
                raise UploadRejected(f"{k!r} has shape {tuple(v.shape)}, expected "
                                     f"{tuple(reference[k].shape)}")


@dataclass
class BoundStage(Stage):
    """Per-sample L2 clipping. It acts inside the payload task (``bound.clip`` on each row,
    before the rows are summed), so both halves pass the payload through."""

    bound: Bound = field(default_factory=NoBound)
    name = "bound"

    def client(self, payload: Any, rel: Release) -> Any:
        return payload

    def server(self, total: Payload, rel: Release) -> Payload:
        return total


@dataclass
class NoiseStage(Stage):
    """Gaussian noise of the uploads, charged to the per-client accountant of ``dp``
    (privacy/dp_accounting.py ``DPAccounting``). Client half: each client's share of the variance
    from a generator seeded from OS entropy (privacy/noise.py); server half: the key
    holder's top-up for planned uploads missing from the sum. The guarantee holds while the
    noise stays secret: not with ``seeded`` (--insecure-seeded-noise)."""

    dp: DPAccounting
    seed: int = 0
    seeded: bool = False
    name = "noise"

    def open(self, rel: Release) -> None:
        self.dp.check(rel.label, rel.asked)  # stop before a release that would exceed the budget

    def admit(self, rel: Release) -> None:
        self.dp.admit(rel.label, [rel.client])  # the client's own ledger (client_ledger.py)

    def client(self, payload: Payload, rel: Release) -> Payload:
        g = noise_generator(self.seed, rel.round_, rel.client, 101, seeded=self.seeded)
        noisy = self.dp.noise(payload, rel.label, g, self.dp.share(rel.label))
        return symmetrise(noisy, self.dp.symmetric(rel.label))

    def server(self, total: Payload, rel: Release) -> Payload:
        share = self.dp.topup_share(rel.label, rel.arrived)
        if share <= 0:
            return total
        g = noise_generator(self.seed, rel.round_, 10_000 + rel.arrived, 102,
                            seeded=self.seeded)
        return symmetrise(self.dp.noise(total, rel.label, g, share=share),
                          self.dp.symmetric(rel.label))

    def close(self, rel: Release) -> None:
        self.dp.record(rel.label, rel.asked)

    def before_training(self, clients: list[int] | None) -> None:
        if DPSGD_RELEASE in self.dp.sigmas:
            self.dp.check(DPSGD_RELEASE, clients)
            if clients is not None:  # each client's own ledger (a Flower node: its own)
                self.dp.admit(DPSGD_RELEASE, clients)

    def after_training(self, clients: list[int] | None) -> None:
        if DPSGD_RELEASE in self.dp.sigmas:
            self.dp.record(DPSGD_RELEASE, clients)

    @property
    def uniform_weights(self) -> bool:
        return bool(self.dp.covers_updates)

    def state_dict(self) -> dict[str, Any]:
        return self.dp.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dp.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        return self.dp.summary()


@dataclass
class ClearWire(Wire):
    """Uploads in the clear: the server validates, records and adds each one."""

    name = "clear"

    def client(self, payload: Payload, rel: Release) -> Payload:
        return payload

    def deliver(self, uploads: Iterable[tuple[int, Any]], rel: Release,
                finish: Finish) -> Payload:
        total: Payload | None = None
        reference: Payload | None = None
        for client, payload in uploads:
            try:
                validate_upload(payload, reference)
            except UploadRejected as exc:
                rel.log.reject(rel.round_, rel.label, client, exc)
                continue
            reference = reference or payload
            rel.transcript.record(round_=rel.round_, label=rel.label, view="plain-upload",
                                  client=client, tensors=payload, bytes=payload_bytes(payload))
            if total is None:
                total = {k: v.detach().to(torch.float64).clone() for k, v in payload.items()}
            else:
                for k, v in payload.items():
                    total[k] += v.to(torch.float64)
            rel.arrived += 1
        if total is None:
            rel.log.raise_skipped(rel.round_, rel.label, Reason.NO_VALID_UPLOAD)
        assert total is not None
        return finish(total, rel)
