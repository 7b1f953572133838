"""The uplink every calibration payload goes through: an ordered list of stages.

``bound -> noise -> wire`` (privacy/stages.py): client halves run in order on each client's
payload (the bound acts inside the payload task, through ``Bound.clip`` on each row), the
wire (in the clear, or CKKS-encrypted: privacy/secagg_stage.py) turns the uploads into their
sum, and the server halves run in reverse on that sum where it is in the clear. The uplink
runs them without knowing what they are; calibrators see the sum alone and cannot tell which
stages ran. In this simulator one object plays every role (clients, server, key holder),
but each role only touches what it would hold in a deployment: the server's aggregator loads
the public context alone, and the transcript records the server's view. Under Flower the
same stages run on the nodes and the server (flower/stage_messages.py).

The model updates go through the update stages the same way (privacy/uplink_updates.py:
client halves in order, server halves in reverse, at most one wire that sums them); what a
run keeps of its stages, for resume and for ``summary.json``, is gathered in
privacy/uplink_record.py.

Guarantees are never weakened silently: a release that would exceed any participant's budget
stops the run (``PrivacyBudgetError``) before anything is released; a client whose own
ledger refuses the release (``BudgetRefused``, privacy/client_ledger.py) sends nothing, and
like a rejected upload it is dropped and the release goes on, the key holder topping the
distributed noise up to the planned variance; a release with fewer than two valid uploads,
or an aggregate that fails the key holder's magnitude check, is skipped
(``ReleaseSkipped``). Noise comes from OS entropy (privacy/noise.py), never from the public
run seed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from privfedcal.errors import BudgetRefused, ReleaseSkipped, UploadRejected, UsageError
from privfedcal.privacy.bound import Bound, NoBound, Payload
from privfedcal.privacy.reasons import Reason, reason_of
from privfedcal.privacy.reasons import record as reason_record
from privfedcal.privacy.release_journal import ReleaseJournal, charge_of, contributors_party
from privfedcal.privacy.stages import (
    MIN_SECAGG_CLIENTS,
    BoundStage,
    ClearWire,
    NoiseStage,
    Release,
    Stage,
    Wire,
    payload_bytes,
    symmetrise,
    validate_upload,
)
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.update_stage import UpdateStage, join_stages
from privfedcal.privacy.uplink_record import load_stage_states, protection_summary, stage_states
from privfedcal.privacy.uplink_updates import UpdatePath

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting

log = logging.getLogger("privfedcal.uplink")

S = TypeVar("S", bound=Stage | UpdateStage)


def default_stages() -> list[Stage]:
    return [BoundStage(NoBound()), ClearWire()]


@dataclass
class Uplink(UpdatePath):
    """An ordered list of stages ending in a wire. With the default (no bound, in the
    clear), the server sees every client's payload (and the transcript records it)."""

    stages: list[Stage] = field(default_factory=default_stages)
    seeded_noise: bool = False  # --insecure-seeded-noise: noise from the public seed
    #: the protections of the model updates, in client order (privacy/update_stage.py)
    update_stages: list[UpdateStage] = field(default_factory=list)
    hide_counts: bool = False
    hints: list[str] = field(default_factory=list)  # advice printed with the run's notes
    rejected: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    #: each party's journal of its DP releases (privacy/release_journal.py): a release
    #: redone after a stop re-sends the journaled value (None: no DP release to keep)
    journal: ReleaseJournal | None = None

    def __post_init__(self) -> None:
        if not self.stages or not isinstance(self.stages[-1], Wire):
            raise UsageError("the uplink's last stage must be a wire (ClearWire or "
                             "EncryptStage)")
        if any(isinstance(s, Wire) for s in self.stages[:-1]):
            raise UsageError("the uplink has one wire, its last stage")
        if sum(s.wire for s in self.update_stages) > 1:
            raise UsageError("the model updates have at most one wire")
        taker = next((s for s in self.update_stages if s.takes), None)
        halves = [s.name for s in self.update_stages if s is not taker and s.has_halves]
        if taker is not None and halves:
            raise UsageError(f"update stage {taker.name!r} receives the round itself: the "
                             f"halves of {', '.join(halves)} would not run beside it")
        join_stages(self.update_stages)

    def find(self, kind: type[S]) -> S | None:
        """The stage of type ``kind`` (of the uploads or of the updates), if the uplink
        has one."""
        return next((s for s in [*self.stages, *self.update_stages]
                     if isinstance(s, kind)), None)

    @property
    def accounting(self) -> DPAccounting | None:
        """The run's ``DPAccounting`` (its noise plan, accountants and ledgers): the noise
        stage's, else an update stage's; None without DP."""
        noise = self.find(NoiseStage)
        if noise is not None:
            return noise.dp
        return next((s.accounting for s in self.update_stages
                     if s.accounting is not None), None)

    @property
    def bound(self) -> Bound:
        """The per-sample bound the payload tasks apply (the bound stage's client half)."""
        stage = self.find(BoundStage)
        return stage.bound if stage is not None else NoBound()

    @property
    def wire(self) -> Wire:
        return self.stages[-1]  # type: ignore[return-value]

    # ---- the pipeline ----------------------------------------------------------------------
    def release(self, label: str, round_: int, asked: list[int], clients: list[int],
                example: Payload, transcript: Transcript) -> Release:
        return Release(label, round_, list(asked), list(clients), example, transcript, self)

    def open(self, rel: Release) -> None:
        """Server, before clients compute: every stage's ``open`` in order."""
        for stage in self.stages:
            stage.open(rel)

    def admit(self, rel: Release) -> None:
        """Client ``rel.client`` agrees to make the release, or refuses it
        (``BudgetRefused``: past its own ledger's planned count, privacy/client_ledger.py)."""
        for stage in self.stages:
            stage.admit(rel)

    def attach_journal(self, journal: ReleaseJournal) -> None:
        """Keep ``journal`` for every DP release of this run: the noised calibration uploads
        and the key holder's sums of them, and each update stage's own (told whether a
        stage noises the model updates: DP-SGD's noise stage, or an update stage)."""
        noise = self.find(NoiseStage)
        if noise is not None:
            self.journal = journal
        noised = ((noise is not None and noise.dp.covers_updates)
                  or any(s.noises_updates for s in self.update_stages))
        for stage in self.update_stages:
            stage.attach_journal(journal, noised)

    def client_side(self, payload: Payload, rel: Release) -> Any:
        """One client's upload: the client halves in order (``rel.client`` is the client).
        With a journal, the payload as it reaches the wire (noised, not yet encrypted) is
        journaled before it leaves, or, if this client made this release before a stop,
        replaced by the journaled one: a release is never redrawn."""
        out: Any = payload
        noise = self.find(NoiseStage) if self.journal is not None else None
        for stage in self.stages:
            if stage is self.wire and noise is not None:  # noised: a DP release
                assert self.journal is not None
                out = self.journal.once(rel.round_, rel.label, rel.client, out,
                                        charge=charge_of(noise.dp, rel.label))
            out = stage.client(out, rel)
        return out

    def finish(self, total: Payload, rel: Release) -> Payload:
        """Where the sum is in the clear: server halves of the stages before the wire, in
        reverse order (the key holder's node under encryption)."""
        for stage in reversed(self.stages[:-1]):
            total = stage.server(total, rel)
        return total

    def server_side(self, uploads: Iterable[tuple[int, Any]], rel: Release) -> Payload:
        """The server's half of the release: the wire's sum, the remaining server halves,
        the released aggregate recorded when the uploads were hidden, every ``close``."""
        start = len(rel.transcript.entries)
        total = self.wire.deliver(uploads, rel, self.finish)
        total = {k: v.to(torch.float64) for k, v in total.items()}
        if rel.hidden and self.journal is not None:  # the key holder's release, once
            total = self.journal.once(rel.round_, rel.label,
                                      contributors_party(_senders(rel, start)), total)
        if rel.hidden:
            rel.transcript.record(round_=rel.round_, label=rel.label, view="aggregate",
                                  client=None, tensors=total, clients=rel.arrived)
        for stage in self.stages:
            stage.close(rel)
        return total

    def aggregate(self, uploads: Iterable[tuple[int, Payload]], *, round_: int, label: str,
                  transcript: Transcript, asked: list[int] | None = None) -> Payload:
        """Every role of one release in this process: open, client halves, server halves.

        With ``asked`` (the clients asked for an upload, in order), ``uploads`` may be lazy,
        each payload computed when it is reached: the release then holds one client's
        payload at a time besides the wire's running sum (an encrypting wire also keeps the
        ciphertexts of cohorts not yet complete), so its memory does not grow with the
        number of clients. An invalid upload found on the way is dropped as a rejected one is (the
        noise topped up); without ``asked`` every upload is validated before the release
        opens."""
        if asked is None:
            uploads = list(uploads)
            asked = [c for c, _ in uploads]
            valid = self._validate(uploads, round_, label)
            clients, stream = [c for c, _ in valid], iter(valid)
        else:
            stream = self._validated(uploads, round_, label)
            first = next(stream, None)
            if first is None:
                self.raise_skipped(round_, label, Reason.NO_VALID_UPLOAD)
            assert first is not None  # raise_skipped raised
            valid = [first]
            clients, stream = list(asked), itertools.chain(valid, stream)
        rel = self.release(label, round_, asked, clients, valid[0][1], transcript)
        del valid  # the stream alone holds the uploads from here
        self.open(rel)
        return self.server_side(self._client_halves(stream, rel), rel)

    def _client_halves(self, valid: Iterator[tuple[int, Payload]],
                       rel: Release) -> Iterator[tuple[int, Any]]:
        """Each valid upload through its client's halves, as the wire takes it."""
        for client, payload in valid:
            try:
                self.admit(rel.at(client))
                yield client, self.client_side(payload, rel.at(client))
            except UploadRejected as exc:  # dropped; the release goes on, noise topped up
                self.reject(rel.round_, rel.label, client, exc)
            except BudgetRefused as exc:  # not sent; the release goes on without it
                self.reject(rel.round_, rel.label, client, Reason.REFUSED_BY_CLIENT, str(exc))

    def reject(self, round_: int, label: str, client: int,
               reason: Reason | str | BaseException, detail: str = "") -> None:
        """Record a dropped upload by its declared code (privacy/reasons.py); the text of
        the check goes to the log only."""
        code = reason_of(reason)
        log.warning("round %d %s: upload of client %d rejected (%s)%s", round_, label,
                    client, code, f": {detail or reason}" if detail or reason != code else "")
        self.rejected.append(reason_record(round_, label, code, client=client))

    def raise_skipped(self, round_: int, label: str, reason: Reason | str | BaseException,
                      detail: str = "", **public: int) -> None:
        """Record that the release is not made, by its declared code and public numbers,
        and stop it (``ReleaseSkipped``, whose text is the record's)."""
        code = reason_of(reason, Reason.UNNAMED)
        log.warning("round %d %s: release skipped (%s)%s", round_, label, code,
                    f": {detail or reason}" if detail or reason != code else "")
        entry = reason_record(round_, label, code, **public)
        self.skipped.append(entry)
        numbers = "".join(f", {k} {entry[k]}" for k in public)
        raise ReleaseSkipped(f"round {round_} {label}: release skipped ({code}{numbers})",
                             reason=code)

    def _validated(self, uploads: Iterable[tuple[int, Payload]], round_: int,
                   label: str) -> Iterator[tuple[int, Payload]]:
        """The uploads that are well formed and shaped like the first valid one; the others
        rejected on the way."""
        reference: Payload | None = None
        for client, payload in uploads:
            try:
                validate_upload(payload, reference)
            except UploadRejected as exc:
                self.reject(round_, label, client, exc)
                continue
            reference = payload if reference is None else reference
            yield client, payload

    def _validate(self, uploads, round_, label) -> list[tuple[int, Payload]]:
        valid = list(self._validated(uploads, round_, label))
        if not valid:
            self.raise_skipped(round_, label, Reason.NO_VALID_UPLOAD)
        return valid

    # ---- DP-SGD local training is a release too ---------------------------------------------
    def before_local_training(self, clients=None) -> None:
        for stage in self.stages:
            stage.before_training(clients)

    def after_local_training(self, clients=None) -> None:
        for stage in self.stages:
            stage.after_training(clients)

    # ---- resume and summary (privacy/uplink_record.py) ------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: every stage's own state by its name, the update
        stages' as the uploads' (the noise stage's accountants and ledgers, the encrypt
        stage's record, DP-FedAvg's clip, an extension's own), the rejected and skipped
        releases."""
        return {"stages": stage_states([*self.stages, *self.update_stages]),
                "rejected": self.rejected, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_stage_states(state, self.stages, self.update_stages)
        self.rejected = list(state.get("rejected", []))
        self.skipped = list(state.get("skipped", []))

    def summary(self) -> dict[str, Any]:
        """What the run's protection was, for ``summary.json`` (``protection_summary``)."""
        return protection_summary(self.stages, self.update_stages,
                                  hide_counts=self.hide_counts,
                                  hides_updates=self.hides_updates,
                                  seeded_noise=self.seeded_noise)


def _senders(rel: Release, start: int) -> list[int]:
    """The clients whose ciphertexts entered ``rel``'s sum: recorded since entry ``start``."""
    return [int(e["client"]) for e in rel.transcript.entries[start:]
            if e["view"] == "ciphertext" and e["label"] == rel.label
            and e["round"] == rel.round_]


__all__ = ["MIN_SECAGG_CLIENTS", "Uplink", "payload_bytes", "symmetrise",
           "validate_upload"]
