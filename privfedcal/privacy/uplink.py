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
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from privfedcal.errors import BudgetRefused, ReleaseSkipped, UploadRejected, UsageError
from privfedcal.privacy.bound import Bound, NoBound, Payload
from privfedcal.privacy.noise import INSECURE_STATEMENT
from privfedcal.privacy.reasons import Reason, reason_of
from privfedcal.privacy.reasons import record as reason_record
from privfedcal.privacy.release_journal import ReleaseJournal, charge_of, contributors_party
from privfedcal.privacy.releases import UPDATE_RELEASE
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

log = logging.getLogger("privfedcal.uplink")

#: the extra entry of a securely aggregated model update: the client's FedAvg weight w_k,
#: summed with the weighted states so that the server can divide by the weight sum
UPDATE_WEIGHT = "__weight"

S = TypeVar("S", bound=Stage)


def default_stages() -> list[Stage]:
    return [BoundStage(NoBound()), ClearWire()]


@dataclass
class Uplink:
    """An ordered list of stages ending in a wire. With the default (no bound, in the
    clear), the server sees every client's payload (and the transcript records it)."""

    stages: list[Stage] = field(default_factory=default_stages)
    seeded_noise: bool = False  # --insecure-seeded-noise: noise from the public seed
    updates: Uplink | None = None  # --secagg-updates: the model updates' encrypted uplink
    user_dp: Any = None  # --dp-updates: DP-FedAvg of the model updates (privacy/user_dp.py)
    update_seconds: list[float] = field(default_factory=list)  # its wall time per round
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

    def find(self, kind: type[S]) -> S | None:
        """The stage of type ``kind``, if the uplink has one."""
        return next((s for s in self.stages if isinstance(s, kind)), None)

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
        and the key holder's sums of them, DP-FedAvg's updates, and the model updates' wire
        where DP-SGD or DP-FedAvg noises them."""
        noise = self.find(NoiseStage)
        if noise is not None:
            self.journal = journal
        if self.user_dp is not None:
            self.user_dp.journal = journal
        if self.updates is not None and (self.user_dp is not None or (
                noise is not None and noise.dp.covers_updates)):
            self.updates.journal = journal

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

    # ---- model updates --------------------------------------------------------------------
    def update_weights(self, sizes: list[float]) -> list[float]:
        """FedAvg weights of a round: client sizes n_k, except where the sizes are private
        data: uniform (public nominal) weights, so no size leaves a client. Sizes are
        private under --dp-train, and under --hide-counts with updates in the clear (a
        size is the total of the client's hidden class counts: with a cohort's determined
        sums it splits them, ``count_splits.py``); under --secagg-updates they travel
        inside the encrypted sum."""
        if self.nominal_weights:
            return [1.0] * len(sizes)
        return list(sizes)

    @property
    def nominal_weights(self) -> bool:
        """Whether model updates are averaged with uniform public weights."""
        return (any(s.uniform_weights for s in self.stages)
                or (self.hide_counts and self.updates is None))

    def average_updates(self, sent: Payload, states: list[Payload], weights: list[float],
                        clients: list[int], *, round_: int, transcript: Transcript) -> Payload:
        """Under --secagg-updates: the round's weighted average of the model updates as the
        server obtains it, from the CKKS sum of ``w_k * state_k`` and ``w_k`` (ciphertext
        sizes and the aggregate recorded); an aggregate that fails the key holder's check
        leaves the global state as it was. (In the clear the simulator averages the updates
        itself, ``federation/aggregate.py``.)"""
        if self.updates is None:
            raise RuntimeError("average_updates is the secure path: this uplink has no "
                               "--secagg-updates")
        t0 = time.perf_counter()
        keys = [k for k, v in sent.items() if v.is_floating_point()]
        uploads = [(int(c), {UPDATE_WEIGHT: torch.tensor([float(w)], dtype=torch.float64),
                             **{k: st[k].detach().double().cpu() * float(w) for k in keys}})
                   for c, st, w in zip(clients, states, weights, strict=True)]
        try:
            total = self.updates.aggregate(uploads, round_=round_, label=UPDATE_RELEASE,
                                           transcript=transcript)
            weight = float(total.pop(UPDATE_WEIGHT)[0])
            if not weight > 0:
                self.updates.raise_skipped(round_, UPDATE_RELEASE, Reason.WEIGHT_NOT_POSITIVE,
                                           f"decrypted weight sum {weight:g}")
        except ReleaseSkipped:  # recorded by the updates' uplink; the global state stays
            return dict(sent)
        finally:  # its records are the run's: every uplink's rejections listed together
            self.rejected += self.updates.rejected
            self.skipped += self.updates.skipped
            self.updates.rejected, self.updates.skipped = [], []
        out = {k: v.clone() for k, v in sent.items()}  # integer buffers: the global ones
        for k in keys:
            out[k] = (total[k] / weight).to(sent[k].dtype).to(sent[k].device)
        self.update_seconds.append(time.perf_counter() - t0)
        return out

    @staticmethod
    def recipe(spec) -> dict[str, Any]:
        """The public local-training recipe (the run's resolved ``LocalSpec``) the transcript
        records with each update."""
        return {"local_epochs": spec.local_epochs, "batch_size": spec.batch_size,
                "lr": spec.lr}

    # ---- DP-SGD local training is a release too ---------------------------------------------
    def before_local_training(self, clients=None) -> None:
        for stage in self.stages:
            stage.before_training(clients)

    def after_local_training(self, clients=None) -> None:
        for stage in self.stages:
            stage.after_training(clients)

    # ---- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: every stage's own state by its name (the noise
        stage's accountants and ledgers, the encrypt stage's record, an extension's own),
        DP-FedAvg's clip, the model updates' wire, the rejected and skipped releases."""
        stages: dict[str, Any] = {}
        for stage in self.stages:
            state = stage.state_dict()
            if state:
                if stage.name in stages:
                    raise RuntimeError(f"two stages named {stage.name!r} hold state")
                stages[stage.name] = state
        return {"stages": stages,
                "user_dp": self.user_dp.state_dict() if self.user_dp is not None else None,
                "updates": self.updates.state_dict() if self.updates is not None else None,
                "rejected": self.rejected, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stages = dict(state.get("stages") or {})
        if "stages" not in state and state.get("dp") is not None:
            stages = {NoiseStage.name: state["dp"]}  # saved when only the noise stage's was
        own = {stage.name: stage for stage in self.stages}
        foreign = sorted(name for name, st in stages.items() if st and name not in own)
        if foreign:
            raise UsageError(f"the checkpoint holds the state of stage(s) {', '.join(foreign)}, "
                             "which this run does not plan: resume with the run's own settings")
        for name, st in stages.items():
            if st:
                own[name].load_state_dict(st)
        if self.user_dp is not None and state.get("user_dp") is not None:
            self.user_dp.load_state_dict(state["user_dp"])  # the adaptive clip's value
        if self.updates is not None and state.get("updates") is not None:
            self.updates.load_state_dict(state["updates"])
        self.rejected = list(state.get("rejected", []))
        self.skipped = list(state.get("skipped", []))

    def summary(self) -> dict[str, Any]:
        """What the run's protection was, for ``summary.json``: each stage's own summary
        (``Stage.summary``), the model updates' secure sum, and a plain statement where no
        stage gives DP."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(stage.summary())
        if self.updates is not None:
            n = len(self.update_seconds)
            out["secagg_updates"] = {
                "model_updates": "CKKS sums of weighted updates and weights; the server sees "
                                 "the aggregate and the summed weight only",
                **self.updates.wire.summary().get("secagg", {}), "rounds": n,
                "mean_seconds_per_round": round(sum(self.update_seconds) / n, 4) if n else None}
        if self.user_dp is not None:  # the sample-level statement, then the user-level one
            user = self.user_dp.summary()
            out["statement"] = f"{out.get('statement', '')}. {user['user_dp']['statement']}"
            out.update(user_dp=user["user_dp"])
        if not out:
            return {}
        dp, encrypted = "epsilon_spent" in out, "secagg" in out
        if encrypted and not dp:
            out["statement"] = ("no differential privacy: the server saw only the sum "
                                "of the calibration uploads (CKKS secure aggregation); model "
                                "updates " + ("only as their CKKS sum" if self.updates
                                              is not None else "travel in the clear"))
            if self.hide_counts and self.updates is None:
                out["statement"] += (", averaged with uniform weights: no client size "
                                     "reaches the server")
        elif self.updates is not None and not dp:
            out["statement"] = ("no differential privacy: the server saw the model updates "
                                "only as their CKKS sum; calibration uploads in the clear")
        out["hide_counts"] = self.hide_counts
        out["noise_source"] = "seeded (insecure)" if self.seeded_noise else "os-entropy"
        if self.seeded_noise:
            out["insecure"] = INSECURE_STATEMENT
            out["statement"] = INSECURE_STATEMENT + ". " + out.get("statement", "")
        return out


def _senders(rel: Release, start: int) -> list[int]:
    """The clients whose ciphertexts entered ``rel``'s sum: recorded since entry ``start``."""
    return [int(e["client"]) for e in rel.transcript.entries[start:]
            if e["view"] == "ciphertext" and e["label"] == rel.label
            and e["round"] == rel.round_]


__all__ = ["MIN_SECAGG_CLIENTS", "UPDATE_WEIGHT", "Uplink", "payload_bytes", "symmetrise",
           "validate_upload"]
