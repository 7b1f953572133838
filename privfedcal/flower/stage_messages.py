"""The uplink's stages split across the wire: client halves on the nodes, sums on the server.

In the simulator one ``Uplink`` plays every role. Under Flower the roles live on different
machines, each executing the protection plan of the same run config (privfedcal/privacy/planner.py
``plan_protection``, privacy/executor.py), so every role runs the same stage objects
(privacy/stages.py); this module only moves their inputs and outputs through messages:

* server (``flower/flower_simulator.py``): ``Uplink.open`` (the noise stage checks the budget; the
  encrypt stage asks the key holder for a fresh key through ``RemoteKeys``), sends the
  release's ``Sealing`` (public context, layout, pad size) with the task, and hands the
  replies to ``Uplink.server_side``: the wire validates and adds (ciphertexts under the
  public context only), the transcript records what the server saw, the accountant records.
* client (``client_upload``): ``Uplink.client_side`` on the bounded payload, that is the
  node's own noise stage (OS entropy; its share of the variance from the run config, never
  from the server's message) and its own wire: in the clear as an ArrayRecord, or encrypted
  under the key holder's public context, padded, as bytes in a ConfigRecord. Whether to
  encrypt follows the node's run config, not the server's message.
* key holder: the SuperNode of client ``flower.key-holder`` (default 0). It draws fresh CKKS
  keys for every release (``query.keygen``), keeps the secret key in its own
  ``context.state`` (which never leaves the node), decrypts only the server's sum
  (``query.decrypt``), and only when the contributor list sent with it is a union of whole
  public cohorts of at least its own minimum (the server has already withheld any sum that
  fails the whole-run check: privacy/secagg_stage.py), flooded and rounded
  (privacy/secagg.py), runs ``Uplink.finish`` (the server halves of the stages before the
  wire: the noise stage's top-up for planned uploads missing from the sum, as the
  simulator's key holder does), then forgets the key.

When the guarantees stop: if the key-holder node colludes with the server (it could then
decrypt single uploads). A rejected upload is dropped and the release goes on with the noise
topped up, as in the simulator; an aggregate that fails the key holder's magnitude check
(an upload that broke its bound or used a foreign key) is not released (``ReleaseSkipped``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from privfedcal.errors import UploadRejected, UsageError
from privfedcal.federation.hooks import Payload
from privfedcal.flower.link import FlowerRoundError, GridLink
from privfedcal.flower.records import (
    as_bytes,
    as_int,
    as_list,
    record_at,
    record_to_state,
    state_to_record,
)
from privfedcal.privacy.error_codes import CODES, error_code
from privfedcal.privacy.packing import PayloadLayout
from privfedcal.privacy.reasons import from_node_code
from privfedcal.privacy.secagg_stage import Sealing
from privfedcal.privacy.stages import Finish, Release
from privfedcal.privacy.transcript import Transcript

SECAGG = "secagg"            # ConfigRecord sent to clients: public context, layout, pad size
CIPHERTEXT = "ciphertext"    # ConfigRecord in a client's reply: {"data": bytes}
KEY_STATE = "privfedcal.key-holder"


def sealing_record(sealing: Sealing) -> ConfigRecord:
    return ConfigRecord({"public-context": sealing.public, "layout": sealing.layout.to_json(),
                         "pad-to": sealing.pad_to or 0})


def sealing_from_record(record: ConfigRecord) -> Sealing:
    return Sealing(PayloadLayout.from_json(str(record["layout"])),
                   as_bytes(record["public-context"]), as_int(record["pad-to"]) or None)


def _release(uplink: Any, label: str, round_: int) -> Release:
    """A release as a node sees it: no transcript (that is the server's view)."""
    return uplink.release(label, round_, [], [], {}, Transcript(None))


# ---- client side ------------------------------------------------------------------------------
def client_upload(uplink: Any, payload: Payload, *, label: str, round_: int, client: int,
                  secagg: ConfigRecord | None) -> dict[str, Any]:
    """The reply records of one client's upload: the uplink's client halves, in order."""
    rel = _release(uplink, label, round_).at(client)
    if uplink.wire.hides_uploads:
        if secagg is None:
            raise UsageError("the run config asks for secure aggregation but the server sent "
                             "no public key: refusing to upload in the clear")
        rel.state["sealing"] = sealing_from_record(secagg)
    out = uplink.client_side(payload, rel)
    if isinstance(out, bytes):
        return {CIPHERTEXT: ConfigRecord({"data": out})}
    return {"payload": state_to_record(out)}


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


def decrypt(context: Any, config: ConfigRecord, uplink: Any) -> RecordDict:
    """Decrypt the server's sum of the uploads of ``contributors`` (flooded, rounded) and run
    the node's own ``Uplink.finish`` on it (the noise top-up); then drop the key. A request
    whose contributor list is missing, or is not a union of whole public cohorts of at least
    this node's minimum (``check_contributors``, from this node's own run config), is
    refused with a code."""
    from privfedcal.privacy.secagg import KeyHolder
    from privfedcal.privacy.secagg_stage import check_contributors, key_holder_release

    kept = context.state.config_records.get(KEY_STATE)
    if kept is None or kept["release"] != config["release"]:
        raise UploadRejected(f"no key for release {config['release']!r} on this node")
    holder = KeyHolder.from_state_dict({
        "format": kept["format"], "params": json.loads(str(kept["params"])),
        "rotations": kept["rotations"], "secret_context": kept["secret-context"],
        "public_context": kept["public-context"]})
    del context.state[KEY_STATE]  # one key per release, used once
    layout = PayloadLayout.from_json(str(config["layout"]))
    secagg = uplink.wire.secagg
    listed = config.get("contributors")
    try:
        # the minimum and the cohorts are this node's own run config, never numbers the
        # server sends; this node is a client too (--secagg-key-holder), so the minimum
        # counts its own upload apart: --secagg-min-clients others besides it
        # (cohorts.secure_minimum)
        n = check_contributors(None if listed is None else [int(c) for c in as_list(listed)],
                               secagg.min_clients, secagg.cohorts)
        total = key_holder_release(holder, [bytes(c) for c in as_list(config["ciphertexts"])], layout, n,
                                   secagg.min_clients)
    except UploadRejected as exc:  # the release is skipped, never half-made
        # the check's text can hold the sum's largest entry: it stays in this node's log,
        # the server gets the code (privacy/error_codes.py)
        code = error_code(exc).value
        logging.getLogger("privfedcal.flower.client").error(
            "release %s: the sum failed the key holder's check; the server is sent only the "
            "code %s", config["release"], code, exc_info=exc)
        return RecordDict({"rejected": ConfigRecord({"reason": code})})
    label, _, round_ = str(config["release"]).rpartition("-")
    rel = _release(uplink, label, int(round_))
    rel.arrived = n
    return RecordDict({"aggregate": state_to_record(uplink.finish(total, rel))})


# ---- server side: the encrypt stage's KeyService, reached by messages ---------------------------
@dataclass
class RemoteKeys:
    """The key holder as a client node: keygen and decryption are messages to it, and the
    server halves after decryption run there (``decrypt`` above), not on the server."""

    link: GridLink
    key_holder: int

    def keygen(self, rel: Release, params: Any) -> bytes:
        release = f"{rel.label}-{rel.round_}"
        content = RecordDict({"config": ConfigRecord(
            {"release": release, "params": json.dumps(params.to_dict())})})
        reply = self._ask(content, "query.keygen", release)
        return bytes(reply.content[SECAGG]["public-context"])

    def _ask(self, content: RecordDict, message_type: str, release: str) -> Any:
        """The key holder's reply; without it no CKKS sum can be opened, whoever else
        replied: the run stops (nothing is released in its place)."""
        try:
            return self.link.exchange(content, [self.key_holder], message_type,
                                      release)[self.key_holder]
        except FlowerRoundError as exc:
            raise FlowerRoundError(
                f"the CKKS key holder (client {self.key_holder}, flower.key-holder) is lost, "
                f"so release {release} cannot be formed; the run stops: {exc}") from None

    def decrypt(self, ciphertexts: list[bytes], layout: PayloadLayout, rel: Release,
                finish: Finish, contributors: Sequence[int]) -> Payload:
        """The key holder's decryption of the sum of ``contributors``' uploads: the list goes
        with the request, and the key holder checks it against the public cohorts."""
        release = f"{rel.label}-{rel.round_}"
        content = RecordDict({"config": ConfigRecord({
            "release": release, "contributors": [int(c) for c in contributors],
            "layout": layout.to_json(), "ciphertexts": ciphertexts})})
        reply = self._ask(content, "query.decrypt", release).content
        if "rejected" in reply:
            code = str(reply["rejected"]["reason"])  # its text only in the log, if declared
            rel.log.raise_skipped(rel.round_, rel.label, from_node_code(code),
                                  f"the key holder sent {code if code in CODES else 'an undeclared code'}")
        return record_to_state(reply["aggregate"])


def received_upload(content: RecordDict, device: Any = None) -> Any:
    """A client's upload as the server received it: ciphertext bytes, a payload, or empty
    bytes (rejected by either wire) if it sent neither."""
    if CIPHERTEXT in content:
        return as_bytes(record_at(content, CIPHERTEXT, ConfigRecord)["data"])
    if "payload" in content:
        return record_to_state(record_at(content, "payload", ArrayRecord), device)
    return b""
