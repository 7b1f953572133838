"""The encrypt stage of the uplink (its wire): one CKKS session per release, fresh keys each time.

Roles: clients encrypt under the key holder's public context; the server's aggregator loads
that public context only (TenSEAL's ``is_private()`` is false there) and adds ciphertexts; the
key holder decrypts the sum alone, checks it against the declared magnitude bound, and
releases it rounded to a grid coarser than the CKKS error (Li & Micciancio 2020: exact
decryptions handed to a party that holds the ciphertexts enable key recovery). Keys are new
for every release (rotation per calibration step). The magnitude bound, from which the CKKS
modulus chain and scale are chosen, follows from the clip bounds, the number of samples and
clients, and the DP noise (10 standard deviations).

``EncryptStage`` is the uplink's wire under --secagg (privacy/stages.py): its client half
encrypts, its server half adds ciphertexts under the public context and has the key holder
decrypt the sum and run the remaining server halves. Who holds the keys is a ``KeyService``:
in-process here (``LocalKeys``), a client node reached by messages under Flower
(flower/stage_messages.py).

Before anything leaves the key holder, two rules hold on the sum's actual contributors: the
server adds whole public cohorts only and decrypts nothing that, with the run's sums already
released, would isolate fewer than --secagg-min-clients clients (``EncryptStage.deliver``:
withheld, the run goes on without it); the key holder decrypts only a sum whose contributor
list, sent with the request, is a union of whole public cohorts of at least its minimum
(``check_contributors``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from privfedcal.errors import UploadRejected
from privfedcal.privacy.bound import Payload
from privfedcal.privacy.cohorts import release_isolates, whole_cohorts
from privfedcal.privacy.packing import PayloadLayout
from privfedcal.privacy.reasons import Reason
from privfedcal.privacy.secagg import (
    CKKSParams,
    KeyHolder,
    ServerAggregator,
    encrypt_payload,
    load_public_context,
)
from privfedcal.privacy.stages import MIN_SECAGG_CLIENTS, Finish, Release, Wire
from privfedcal.privacy.transcript import secure_participants

if TYPE_CHECKING:
    from privfedcal.privacy.plan import CKKSPlan

PAD_SLACK = 1.25  # zstd output of SEAL ciphertexts stays within ~1.12x their entropy
NOISE_SIGMAS = 10.0  # P(|N(0,1)| > 10) ~ 1e-23: noise never breaks the declared bound
PRECISION = 1e-10  # absolute CKKS error per aggregate entry: small, so decryption flooding is small
#: ``skipped_releases``' code of a secure sum the whole-run check withheld (privacy/reasons.py)
WITHHELD = Reason.WITHHELD_ISOLATING.value


def padded_size(params: CKKSParams, layout: PayloadLayout) -> int:
    """A fixed wire size for every upload of a release (hidden counts): TenSEAL compresses
    ciphertexts, so their byte size varies slightly with the encryption randomness; padding
    to a bound computed from the parameters alone makes every upload the same size."""
    chunks = -(-layout.size // params.slots)
    entropy = 2 * params.poly_modulus_degree * sum(params.coeff_mod_bit_sizes[:-1]) / 8
    return int(chunks * (PAD_SLACK * entropy + 4096) + 4096)


def pad(data: bytes, size: int | None) -> bytes:
    if size is None:
        return data
    if len(data) + 8 > size:
        raise UploadRejected(f"upload of {len(data)} bytes exceeds the padded size {size}")
    return len(data).to_bytes(8, "big") + data + bytes(size - 8 - len(data))


def unpad(data: bytes) -> bytes:
    """Server side: drop the padding (a length prefix says where the upload ends)."""
    if len(data) < 8:
        raise UploadRejected("upload shorter than its length prefix")
    n = int.from_bytes(data[:8], "big")
    if n > len(data) - 8:
        raise UploadRejected("upload truncated: length prefix exceeds the data")
    return data[8 : 8 + n]


@dataclass
class CKKSSettings:
    """The run's CKKS settings: magnitude bounds per payload key, the noise they must leave
    room for, the parameters each release used (the summary's record). Not a stage:
    ``EncryptStage`` below reads it."""

    bounds: dict[str, float]  # largest |aggregate entry| per payload key, before noise
    dp: Any
    clients: int
    hide_counts: bool = True
    #: fewest uploads in a sum: --secagg-min-clients, plus one when the key holder is a
    #: client (cohorts.secure_minimum)
    min_clients: int = MIN_SECAGG_CLIENTS
    params_used: dict[str, dict] = field(default_factory=dict)
    #: the bound of a key absent from ``bounds`` (model updates: one bound for every
    #: parameter tensor); None: such a key is an error
    default_bound: float | None = None
    #: the run's fixed cohorts (privfedcal/privacy/cohorts.py): a sum holds whole public cohorts
    #: only, a member not asked, missing or rejected takes its cohort out; None: no cohort rule
    cohorts: tuple[tuple[int, ...], ...] | None = None
    #: label -> the release's keys that hold symmetric matrices (``ReleaseSpec.symmetric``):
    #: only their upper triangle is encrypted; a label without an entry packs every entry
    symmetric: dict[str, frozenset[str]] = field(default_factory=dict)
    #: clients whose own values the key holder knows (itself, when it is a client:
    #: ``cohorts.observers_own``); ``min_clients`` counts them on top of --secagg-min-clients
    known: tuple[int, ...] = ()

    @classmethod
    def from_plan(cls, plan: CKKSPlan, dp: Any) -> CKKSSettings:
        """The live settings of the planned CKKS set-up ``plan`` (privacy/plan.py), with the
        run's noise plan ``dp`` (None without DP) whose noise the bounds leave room for."""
        return cls(bounds=dict(plan.bounds), dp=dp, clients=plan.clients,
                   hide_counts=plan.hide_counts, min_clients=plan.min_clients,
                   default_bound=plan.default_bound, cohorts=plan.cohorts,
                   symmetric=dict(plan.symmetric), known=tuple(plan.known))

    @property
    def group_minimum(self) -> int:
        """--secagg-min-clients m: the fewest clients any combination of the run's sums may
        single out (``min_clients`` less the clients the key holder knows)."""
        return max(self.min_clients - len(self.known), 1)

    def max_abs(self, label: str, keys) -> float:
        keys = list(keys)
        stds = self.dp.stds(keys, label) if self.dp is not None else {}
        return max(self._bound(k) + NOISE_SIGMAS * stds.get(k, 0.0) for k in keys)

    def _bound(self, key: str) -> float:
        if key in self.bounds:
            return self.bounds[key]
        if self.default_bound is None:
            raise UploadRejected(f"no magnitude bound for payload key {key!r}")
        return self.default_bound

    def summary(self) -> dict[str, Any]:
        out = {"scheme": "CKKS (TenSEAL)", "params": self.params_used,
               "min_clients": self.min_clients,
               "keys": "fresh per release; server holds the public context only",
               "release_rounding": "2 x CKKS error bound"}
        if self.cohorts is not None:
            out["cohorts"] = [list(c) for c in self.cohorts]
        return out


@dataclass
class Sealing:
    """What a client needs to encrypt its upload for one release: the layout, the key
    holder's public context (refused if it holds a secret key) and the padded size."""

    layout: PayloadLayout
    public: bytes
    pad_to: int | None = None
    _context: Any = None

    def context(self) -> Any:
        """The public context, loaded once; one holding a secret key is refused."""
        if self._context is None:
            context = load_public_context(self.public, n_threads=1)
            if context.is_private():
                raise UploadRejected("the server sent a context holding a secret key")
            self._context = context
        return self._context

    def seal(self, payload: Payload) -> bytes:
        return pad(encrypt_payload(payload, self.layout, self.context()).to_bytes(), self.pad_to)


class KeyService(Protocol):
    """The key holder's role: fresh keys per release, one decryption of the server's sum."""

    def keygen(self, rel: Release, params: CKKSParams) -> bytes:
        """The public context of a new key for ``rel``."""
        ...

    def decrypt(self, ciphertexts: list[bytes], layout: PayloadLayout, rel: Release,
                finish: Finish, contributors: Sequence[int]) -> Payload:
        """The sum of the uploads of ``contributors`` (the clients whose ciphertexts the
        server added), flooded and rounded, through ``finish``; refused unless they are
        whole public cohorts (``check_contributors``)."""
        ...


def check_contributors(contributors: Sequence[int] | None, min_clients: int,
                       cohorts: Sequence[Sequence[int]] | None) -> int:
    """The key holder's own rule before it decrypts a sum, from what it knows itself (the
    run's public cohorts and its minimum), whatever the server asks: the sum's contributor
    list is given, names no client twice, holds at least ``min_clients`` and is a union of
    whole public cohorts. Returns the number of contributors; raises UploadRejected."""
    if contributors is None:
        raise UploadRejected("the decryption request names no contributors: not decrypted",
                             reason=Reason.KEY_HOLDER_REFUSED)
    if not whole_cohorts(contributors, cohorts):
        raise UploadRejected(f"the {len(contributors)} contributors are not whole cohorts: "
                             "not decrypted", reason=Reason.KEY_HOLDER_REFUSED)
    if len(contributors) < min_clients:
        raise UploadRejected(f"a sum of {len(contributors)} upload(s) is below this key "
                             f"holder's minimum of {min_clients}: not decrypted",
                             reason=Reason.KEY_HOLDER_REFUSED)
    return len(contributors)


def key_holder_release(holder: KeyHolder, ciphertexts: list[bytes], layout: PayloadLayout,
                       n: int, min_clients: int) -> Payload:
    """The key holder's decryption of a sum of ``n`` uploads: flooded, then rounded to twice
    the CKKS error bound (privacy/secagg.py); raises UploadRejected on a failed check, and
    for a sum of fewer than ``min_clients`` uploads (the key holder's own setting, whatever
    the server asks: an aggregate of one would be that client's upload)."""
    if n < min_clients:
        raise UploadRejected(f"a sum of {n} upload(s) is below this key holder's minimum of "
                             f"{min_clients}: not decrypted", reason=Reason.TOO_FEW_UPLOADS)
    return holder.decrypt_aggregate(ciphertexts, layout, n_clients=n,
                                    round_to=2 * holder.params.error_bound(n))


@dataclass
class LocalKeys:
    """The key holder in this process (the simulator): keys live in the release's state.
    Its minimum and cohorts are the run's (``EncryptStage`` sets them)."""

    min_clients: int = MIN_SECAGG_CLIENTS
    cohorts: tuple[tuple[int, ...], ...] | None = None

    def keygen(self, rel: Release, params: CKKSParams) -> bytes:
        holder = KeyHolder(params)  # fresh keys for every release
        rel.state["key-holder"] = holder
        return holder.public_context_bytes()

    def decrypt(self, ciphertexts: list[bytes], layout: PayloadLayout, rel: Release,
                finish: Finish, contributors: Sequence[int]) -> Payload:
        holder = rel.state.pop("key-holder")  # one key per release, used once
        try:
            n = check_contributors(contributors, self.min_clients, self.cohorts)
            total = key_holder_release(holder, ciphertexts, layout, n, self.min_clients)
        except UploadRejected as exc:
            rel.log.raise_skipped(rel.round_, rel.label, exc, str(exc))
        return finish(total, rel)


@dataclass
class EncryptStage(Wire):
    """CKKS secure aggregation of the uploads: the server sees ciphertexts and the sum.

    A sum holds whole public cohorts only, and is decrypted only when the run's released
    secure sums together with this sum's actual contributors isolate no group of fewer than
    --secagg-min-clients clients (``cohorts.release_isolates``); otherwise it is withheld
    (``WITHHELD`` in ``skipped_releases``) and the run goes on without it."""

    secagg: CKKSSettings
    keys: KeyService = field(default_factory=LocalKeys)
    name = "encrypt"
    hides_uploads = True

    def __post_init__(self) -> None:
        if isinstance(self.keys, LocalKeys):  # the in-process key holder: the run's rule
            self.keys.min_clients = self.secagg.min_clients
            self.keys.cohorts = self.secagg.cohorts

    def open(self, rel: Release) -> None:
        st = self.secagg
        if len(rel.clients) < st.min_clients:
            rel.log.raise_skipped(rel.round_, rel.label, Reason.TOO_FEW_UPLOADS,
                                  uploads=len(rel.clients), min_clients=st.min_clients)
        layout = PayloadLayout.from_payload(rel.example,
                                            symmetric=st.symmetric.get(rel.label, frozenset()))
        params = CKKSParams.for_magnitude(st.max_abs(rel.label, rel.example), PRECISION,
                                          max_clients=st.clients)
        st.params_used[rel.label] = params.to_dict()
        public = self.keys.keygen(rel, params)
        pad_to = padded_size(params, layout) if st.hide_counts else None
        rel.state["sealing"] = Sealing(layout, public, pad_to)

    def client(self, payload: Payload, rel: Release) -> bytes:
        return rel.state["sealing"].seal(payload)

    def deliver(self, uploads: Iterable[tuple[int, Any]], rel: Release,
                finish: Finish) -> Payload:
        sealing: Sealing = rel.state["sealing"]
        server = ServerAggregator(sealing.public, sealing.layout, n_threads=1)
        assert not server.context.is_private()  # the server holds the public context only
        added = self._sum_whole_cohorts(uploads, rel, server, sealing)
        rel.arrived = server.count
        if server.count < self.secagg.min_clients:
            rel.log.raise_skipped(rel.round_, rel.label, Reason.TOO_FEW_UPLOADS,
                                  uploads=server.count, min_clients=self.secagg.min_clients)
        self.check_whole_run(added, rel)
        rel.hidden = True
        return self.keys.decrypt(server.result(), sealing.layout, rel, finish,
                                 contributors=added)

    def check_whole_run(self, contributors: list[int], rel: Release) -> None:
        """Withhold the sum (``ReleaseSkipped``, never decrypted) when the run's released
        secure sums (every label and round, from the transcript) with this sum's actual
        contributors would isolate a group of fewer than --secagg-min-clients clients
        outside those the key holder knows; the reason is a code and public counts."""
        st = self.secagg
        released = secure_participants(rel.transcript.entries)
        clients = max([st.clients, *(int(c) + 1 for row in [*released, contributors]
                                     for c in row)])
        if release_isolates(released, contributors, clients, st.group_minimum,
                            known=st.known) is not None:
            rel.log.raise_skipped(rel.round_, rel.label, Reason.WITHHELD_ISOLATING,
                                  f"{len(contributors)} uploads, {len(released)} earlier sums",
                                  uploads=len(contributors), min_clients=st.group_minimum)

    def _sum_whole_cohorts(self, uploads: Iterable[tuple[int, Any]], rel: Release,
                           server: ServerAggregator, sealing: Sealing) -> list[int]:
        """Add the uploads of every whole public cohort; returns the clients added.

        A sum missing one member of a cohort would, set against the other sums of the run,
        single out the rest of it (privfedcal/privacy/cohorts.py), so a cohort enters only when
        every one of its members' uploads arrived, whether or not the server asked them all
        (a member not asked, lost or rejected takes its cohort out). Uploads wait in their
        cohort; a complete cohort is checked member by member, added once all passed, and
        its ciphertexts dropped. Only incomplete cohorts are held besides the running sum
        (one, when uploads come cohort by cohort, as the simulator sends them)."""
        cohorts = self.secagg.cohorts or ()
        cohort_of = {c: i for i, g in enumerate(cohorts) for c in g}
        waiting: dict[int, dict[int, Any]] = {}
        added: list[int] = []
        seen: set[int] = set()  # clients added so far (a set: releases of thousands)
        for client, data in uploads:
            i = cohort_of.get(client)
            if client in seen or (i is not None and client in waiting.get(i, {})):
                rel.log.reject(rel.round_, rel.label, client, Reason.DUPLICATE_UPLOAD)
                continue
            if i is None:  # in no cohort: its own group
                group = self._add_group([client], {client: data}, server, sealing, rel)
            else:
                waiting.setdefault(i, {})[client] = data
                if len(waiting[i]) < len(cohorts[i]):  # (every key is a member of cohort i)
                    continue
                group = self._add_group(list(cohorts[i]), waiting.pop(i), server, sealing, rel)
            added += group
            seen.update(group)
        for held in waiting.values():
            for client in held:
                rel.log.reject(rel.round_, rel.label, client, Reason.COHORT_INCOMPLETE)
        return added

    @staticmethod
    def _add_group(group: list[int], data_of: dict[int, Any], server: ServerAggregator,
                   sealing: Sealing, rel: Release) -> list[int]:
        """Check every upload of ``group`` (a whole cohort), then add them all; one bad
        upload leaves the whole group out. Returns the clients added."""
        prepared = []
        for client in group:
            data = data_of[client]
            try:
                if not isinstance(data, bytes | bytearray):
                    raise UploadRejected("a plaintext upload where a ciphertext was due")
                raw = bytes(data)
                prepared.append(server.prepare(unpad(raw) if sealing.pad_to is not None else raw))
            except UploadRejected as exc:  # dropped with its cohort; noise topped up
                rel.log.reject(rel.round_, rel.label, client, exc)
                for other in group:
                    if other != client:
                        rel.log.reject(rel.round_, rel.label, other, Reason.COHORT_INCOMPLETE)
                return []
        for client, vecs in zip(group, prepared, strict=True):
            try:
                server.accumulate(vecs)
            except UploadRejected as exc:  # a partial cohort would be in the sum
                rel.log.raise_skipped(rel.round_, rel.label, exc,
                                      f"upload of client {client} could not be added ({exc})")
            rel.transcript.record(round_=rel.round_, label=rel.label, view="ciphertext",
                                  client=client, bytes=len(data_of[client]))
        return list(group)

    def state_dict(self) -> dict[str, Any]:
        """The CKKS parameters of every release made so far (the summary's record)."""
        return {"params_used": dict(self.secagg.params_used)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.secagg.params_used = dict(state.get("params_used", {}))

    def summary(self) -> dict[str, Any]:
        return {"secagg": self.secagg.summary()}
