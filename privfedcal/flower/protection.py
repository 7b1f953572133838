"""The uplink split across the wire: noise and encryption on the nodes, sums on the server.

In the simulator one ``Uplink`` object plays every role. Under Flower the roles live on
different machines, built from the same run config with the same ``build_uplink``:

* client (``client_upload``): the payload task already bounded every per-sample row
  (``uplink.bound``); the node adds its DP noise with the uplink's own noise stage (OS
  entropy; its variance share from the run config, never from the server's message), then,
  with secure aggregation, encrypts under the key holder's public context and pads to a
  fixed size with hidden counts. Plain uploads travel as an ArrayRecord, ciphertexts as bytes
  in a ConfigRecord.
* server (``SecureRelease`` / ``Uplink.sum_clear``): checks the accountant before the release,
  validates and adds uploads (ciphertexts under the public context only), asks the key
  holder to decrypt the sum, records the transcript, and records the release.
* key holder: the SuperNode of client ``flower.key-holder`` (default 0). It draws fresh CKKS
  keys for every release (``query.keygen``), keeps the secret key in its own
  ``context.state`` (which never leaves the node), and decrypts only the server's sum
  (``query.decrypt``), flooded and rounded (privacy/secagg.py), tops the distributed noise up
  for planned uploads that are missing from the sum (``Uplink.key_holder_topup``, as in the
  simulator), then forgets the key.

When the guarantees stop: if the key-holder node colludes with the server (it could then
decrypt single uploads). A rejected upload is dropped and the release goes on with the noise
topped up, as in the simulator; an aggregate that fails the key holder's magnitude check
(an upload that broke its bound or used a foreign key) is not released (``ReleaseSkipped``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict

from privfedcal.errors import UploadRejected
from privfedcal.federation.hooks import Payload
from privfedcal.federation.transcript import Transcript
from privfedcal.flower.link import GridLink
from privfedcal.flower.records import record_to_state, state_to_record
from privfedcal.privacy.uplink import MIN_SECAGG_CLIENTS

SECAGG = "secagg"            # ConfigRecord sent to clients: public context, layout, pad size
CIPHERTEXT = "ciphertext"    # ConfigRecord in a client's reply: {"data": bytes}
KEY_STATE = "privfedcal.key-holder"


# ---- client side ------------------------------------------------------------------------------
def client_upload(uplink: Any, payload: Payload, *, label: str, round_: int, client: int,
                  secagg: ConfigRecord | None) -> dict[str, Any]:
    """The reply records of one client's upload after noise (and encryption)."""
    # the uplink's own client noise stage; the share follows from the run config alone
    noisy = uplink.noise_upload(payload, label, round_, client, uplink.client_share(label))
    if secagg is None:
        return {"payload": state_to_record(noisy)}
    from privfedcal.privacy.packing import PayloadLayout
    from privfedcal.privacy.secagg import encrypt_payload, load_public_context
    from privfedcal.privacy.secagg_stage import pad

    layout = PayloadLayout.from_json(str(secagg["layout"]))
    context = load_public_context(bytes(secagg["public-context"]), n_threads=1)
    if context.is_private():
        raise UploadRejected("the server sent a context holding a secret key")
    pad_to = int(secagg["pad-to"]) or None
    data = pad(encrypt_payload(noisy, layout, context).to_bytes(), pad_to)
    return {CIPHERTEXT: ConfigRecord({"data": data})}


# ---- key holder (a client node) ----------------------------------------------------------------
def keygen(context: Any, config: ConfigRecord) -> RecordDict:
    """Fresh keys for one release; the secret stays in this node's ``context.state``."""
    from privfedcal.privacy.secagg import CKKSParams, KeyHolder

    params = CKKSParams(**json.loads(str(config["params"])))
    holder = KeyHolder(params)
    state = holder.state_dict()
    context.state[KEY_STATE] = ConfigRecord({
        "release": str(config["release"]), "format": state["format"],
        "params": json.dumps(state["params"]), "rotations": int(state["rotations"]),
        "secret-context": state["secret_context"], "public-context": state["public_context"]})
    return RecordDict({SECAGG: ConfigRecord({"public-context": holder.public_context_bytes()})})


def decrypt(context: Any, config: ConfigRecord, uplink: Any = None) -> RecordDict:
    """Decrypt the server's sum of ``n-clients`` uploads (flooded, rounded), top the
    distributed noise up for missing uploads (``uplink``: the node's own, from the run
    config); then drop the key."""
    from privfedcal.privacy.packing import PayloadLayout
    from privfedcal.privacy.secagg import KeyHolder

    kept = context.state.config_records.get(KEY_STATE)
    if kept is None or kept["release"] != config["release"]:
        raise UploadRejected(f"no key for release {config['release']!r} on this node")
    holder = KeyHolder.from_state_dict({
        "format": kept["format"], "params": json.loads(str(kept["params"])),
        "rotations": kept["rotations"], "secret_context": kept["secret-context"],
        "public_context": kept["public-context"]})
    del context.state[KEY_STATE]  # one key per release, used once
    n = int(config["n-clients"])
    layout = PayloadLayout.from_json(str(config["layout"]))
    try:
        total = holder.decrypt_aggregate([bytes(c) for c in config["ciphertexts"]], layout,
                                         n_clients=n, round_to=2 * holder.params.error_bound(n))
    except UploadRejected as exc:  # the release is skipped, never half-made
        return RecordDict({"rejected": ConfigRecord({"reason": str(exc)})})
    if uplink is not None:
        label, _, round_ = str(config["release"]).rpartition("-")
        total = uplink.key_holder_topup(total, label, int(round_), n)
    return RecordDict({"aggregate": state_to_record(total)})


# ---- server side ------------------------------------------------------------------------------
@dataclass
class SecureRelease:
    """One securely aggregated release: keys from the key holder, sum on the server."""

    link: GridLink
    key_holder: int
    label: str
    round_: int
    layout: Any
    params: Any
    public: bytes
    pad_to: int | None

    @classmethod
    def open(cls, link: GridLink, stage: Any, key_holder: int, label: str, round_: int,
             example: Payload) -> SecureRelease:
        from privfedcal.privacy.packing import PayloadLayout
        from privfedcal.privacy.secagg import CKKSParams
        from privfedcal.privacy.secagg_stage import PRECISION, padded_size

        layout = PayloadLayout.from_payload(example, symmetric=frozenset({"outer"} & set(example)))
        params = CKKSParams.for_magnitude(stage.max_abs(label, example.keys()), PRECISION,
                                          max_clients=stage.clients)
        stage.params_used[label] = params.to_dict()
        release = f"{label}-{round_}"
        content = RecordDict({"config": ConfigRecord(
            {"release": release, "params": json.dumps(params.to_dict())})})
        reply = link.exchange(content, [key_holder], "query.keygen", release)[key_holder]
        public = bytes(reply.content[SECAGG]["public-context"])
        pad_to = padded_size(params, layout) if stage.hide_counts else None
        return cls(link, key_holder, label, round_, layout, params, public, pad_to)

    def client_config(self) -> ConfigRecord:
        return ConfigRecord({"public-context": self.public, "layout": self.layout.to_json(),
                             "pad-to": self.pad_to or 0})

    def finish(self, uplink: Any, uploads: list[tuple[int, bytes]],
               transcript: Transcript) -> Payload:
        """Add the ciphertexts (public context only), have the key holder decrypt the sum."""
        from privfedcal.privacy.secagg import ServerAggregator
        from privfedcal.privacy.secagg_stage import unpad

        server = ServerAggregator(self.public, self.layout, n_threads=1)
        assert not server.context.is_private()
        for client, data in uploads:
            try:
                server.add(unpad(data) if self.pad_to else data)
            except UploadRejected as exc:
                uplink.reject(self.round_, self.label, client, str(exc))
                continue
            transcript.record(round_=self.round_, label=self.label, view="ciphertext",
                              client=client, bytes=len(data))
        if server.count < MIN_SECAGG_CLIENTS:
            uplink.skip(self.round_, self.label, f"{server.count} valid upload(s), secure "
                 f"aggregation needs >= {MIN_SECAGG_CLIENTS}")
        release = f"{self.label}-{self.round_}"
        content = RecordDict({"config": ConfigRecord({
            "release": release, "n-clients": server.count, "layout": self.layout.to_json(),
            "ciphertexts": server.result()})})
        reply = self.link.exchange(content, [self.key_holder], "query.decrypt",
                                   release)[self.key_holder].content
        if "rejected" in reply:
            uplink.skip(self.round_, self.label, "aggregate failed the key holder's check: "
                 + str(reply["rejected"]["reason"]))
        total = {k: v.to(torch.float64) for k, v in record_to_state(reply["aggregate"]).items()}
        transcript.record(round_=self.round_, label=self.label, view="aggregate", client=None,
                          tensors=total, clients=server.count)
        return total
