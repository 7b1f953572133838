"""Every field a client sends, declared once: what it holds, which flag makes it, what
protects it, and whether it is charged to the privacy budget or public by declaration.

The same fields leave a client in the simulator (as Python objects that the server side
records in ``transcript/`` and ``clients.jsonl``) and under Flower (as reply records).
``FIXED_FIELDS`` are the fields every run may send (training, discovery, the key holder's
role, the payload's envelope); the calibration payload's keys are not listed here but
derived from the releases the calibrators declare (``payload_fields``: label, keys, what
each holds, participants; every declared key has a sensitivity, so it is protected and
charged). privacy/ sits below the calibrators, so the callers pass the declared releases in
(``privfedcal/calibration/release_fields.py`` does, and prints ``markdown_table`` into
``docs/threat-model.md``). ``tests/privacy/test_client_fields.py`` and
``tests/flower/test_wire_fields.py`` walk the real messages of runs with every protection
on, in the simulator and over Flower's wire, and fail on any field not declared. A field is
named ``message/record/key`` after its Flower reply; ``*`` stands for every key of a model
state or of a payload, and, as the message, for every message (an error reply). A field
with ``values`` may carry only those (a declared vocabulary, never free text: the walks
check every value).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from privfedcal.privacy.error_codes import CODES, MEANING, ErrorCode
from privfedcal.privacy.quantile import QUANTILE_RELEASE
from privfedcal.privacy.releases import UPDATE_RELEASE, ReleaseSpec

CHARGED = "charged"
PUBLIC = "public"


@dataclass(frozen=True)
class ClientField:
    message: str      # the Flower message the client answers ("train", "query.payload", ...)
    record: str       # the record of the reply ("local", "metrics", "payload", ...)
    key: str          # the key inside the record; "*": every key of a state or payload
    holds: str        # what it carries, with its shape
    flag: str         # what makes a client send it
    protection: str   # "DP", "secure aggregation", "DP + secure aggregation", "none"
    budget: str       # CHARGED, or PUBLIC with the reason after a colon
    values: tuple[str, ...] = ()  # the only values it may carry (as str); (): any

    @property
    def name(self) -> str:
        return f"{self.message}/{self.record}/{self.key}"


_META = "node's partition index (int)"
#: Flower's ErrorCode values a node's error reply can carry: privfedcal's ClientApp sends 2
#: (CLIENT_APP_RAISED_EXCEPTION); the SuperNode itself sends 1 (the app failed to load),
#: 7 (its FAB failed verification) and 8 (the ClientApp process stopped responding)
_FLOWER_ERROR_CODES = ("1", "2", "7", "8")
#: the fixed reasons of the SuperNode's own error replies (flwr 1.41:
#: supernode/nodestate/in_memory_nodestate.py, supernode/start_client_internal.py,
#: supernode/runtime/run_clientapp.py)
_FLOWER_REASONS = ("ClientApp stopped responding.", "The FAB could not be verified.",
                   "An exception was raised when attempting to load `ClientApp`")
_CODES_HELD = "; ".join(f"`{c.value}`: {MEANING[c]}" for c in ErrorCode)
_ID = "public: the server addresses nodes by id and names participants in the transcript"

FIXED_FIELDS: tuple[ClientField, ...] = (
    # local training
    ClientField("train", "meta", "partition-id", _META, "always", "none", _ID),
    ClientField("train", "local", "*", "model state after local training (the model's shapes)",
                "always", "none; DP-SGD with --dp-train",
                "public without --dp-train (the summary says the guarantee covers the "
                "calibration uploads only); charged with --dp-train"),
    ClientField("train", "metrics", "num-examples", "client size n_k (int)", "always",
                "none; a constant 0 with --dp-train or --hide-counts",
                "public without --dp-train and --hide-counts (FedAvg weights); carries "
                "nothing with either, whose FedAvg weights are uniform (a size would split "
                "a cohort's hidden counts)"),
    ClientField("train", "metrics", "train-loss", "mean local training loss (float)",
                "without --dp-train", "none; not sent with --dp-train",
                "public without --dp-train (a function of the update the server already "
                "holds in the clear)"),
    # local evaluation: privfedcal's ServerApp never asks for it
    ClientField("evaluate", "meta", "partition-id", _META, "an evaluate message", "none", _ID),
    ClientField("evaluate", "metrics", "num-examples", "client size n_k (int)",
                "an evaluate message; refused under any DP setting", "none",
                "public: only without DP, where the update already reveals it"),
    ClientField("evaluate", "metrics", "loss", "loss of the sent model on the local data",
                "an evaluate message; refused under any DP setting", "none",
                "public: only without DP"),
    ClientField("evaluate", "metrics", "accuracy", "accuracy of the sent model on the local "
                "data", "an evaluate message; refused under any DP setting", "none",
                "public: only without DP"),
    # calibration uploads
    ClientField("query.payload", "meta", "partition-id", _META, "a calibration release",
                "none", _ID),
    ClientField("query.payload", "ciphertext", "data", "CKKS ciphertext of the whole payload "
                "(bytes; its length is seen)", "--secagg", "secure aggregation (+ DP with "
                "--dp-eps)", "charged through the decrypted sum; the length is public: it "
                "depends on the payload layout and CKKS parameters only (padded to one size "
                "with --hide-counts)"),
    # the key holder's role (client flower.key-holder)
    ClientField("query.keygen", "meta", "partition-id", _META, "--secagg, key holder", "none",
                _ID),
    ClientField("query.keygen", "secagg", "public-context", "CKKS public context (bytes, no "
                "secret key)", "--secagg, key holder", "none",
                "public: a public key, independent of any data"),
    ClientField("query.decrypt", "meta", "partition-id", _META, "--secagg, key holder", "none",
                _ID),
    ClientField("query.decrypt", "aggregate", "*", "the flooded decryption of the sum of a "
                "release (the payload's shapes)", "--secagg, key holder",
                "secure aggregation (+ DP with --dp-eps)",
                "charged with --dp-eps (it is the release); without DP unprotected"),
    ClientField("query.decrypt", "rejected", "reason", "that the key holder's check refused "
                f"the sum: the code `{ErrorCode.UPLOAD_REJECTED.value}` (the check's text, "
                "which can hold the sum's largest entry, stays in the node's log)",
                "--secagg, key holder", "none",
                "public: the outcome of a check on public facts (parameters, count) or on the "
                "sum's magnitude bound", values=(ErrorCode.UPLOAD_REJECTED.value,)),
    # dp-clip = "auto" in the Flower plugin: the feature clip's private search
    ClientField("query.clip", "meta", "partition-id", _META, "the Flower plugin with dp-clip "
                "auto", "none", _ID),
    ClientField("query.clip", "histogram", "counts", "noisy counts of the node's feature norms "
                "over a public grid (float64, bins + 1), one per search stage",
                "the Flower plugin with dp-clip auto", "DP (Gaussian, sensitivity 1)",
                CHARGED),
    # the Flower plugin's preflight (before the user's training): the outcome of the node's
    # checks as a code of flower/plugin/preflight_codes.py, never an error's text
    ClientField("query.preflight", "meta", "partition-id", _META + "; -1 if it has none",
                "the Flower plugin's preflight", "none", _ID),
    ClientField("query.preflight", "meta", "settings", "the digest of query.hello's settings "
                "(\"\" when they do not resolve)", "the Flower plugin's preflight", "none",
                "public: a function of the public settings only"),
    ClientField("query.preflight", "preflight", "check", "the first of the node's checks that "
                "failed, or ok: a code of the plugin's fixed list (flower/plugin/"
                "preflight_codes.py: ok, no-partition-id, unknown-setting, bad-setting, "
                "bad-model, bad-head, bad-data, empty-data, batch-keys, bad-batch, "
                "data-does-not-fit-model, head-not-output, internal-error)",
                "the Flower plugin's preflight", "none: a fixed vocabulary",
                "public: which check failed, on the node's configuration, its model and the "
                "form of one batch (keys, types, shape); empty-data and bad-batch (a label "
                "outside the head's classes) can depend on the data, a few bits, like an "
                "error code, not charged"),
    ClientField("query.preflight", "preflight", "key", "the name of the node's setting "
                "that is refused (one of the plugin's setting names), or \"\"",
                "the Flower plugin's preflight", "none",
                "public: a name from the plugin's list, never its value"),
    ClientField("query.preflight", "metrics", "num-examples", "client size n_k (int), 0 "
                "unless every check passed", "the Flower plugin's preflight", "none",
                "public: as query.hello's (FedAvg weights)"),
    # discovery
    ClientField("query.hello", "meta", "partition-id", _META, "start of a Flower run", "none",
                _ID),
    ClientField("query.hello", "meta", "num-partitions", "number of clients (int)",
                "start of a Flower run", "none", "public: in the run config"),
    ClientField("query.hello", "meta", "settings", "a 16-hex digest of the run's public data "
                "settings (dataset, partition scheme and its parameters, clients; the Flower "
                "plugin's: of its public protection settings)",
                "start of a Flower run", "none",
                "public: a function of the public run config only, never of the data seed"),
    ClientField("query.hello", "metrics", "num-examples", "client size n_k (int)",
                "start of a Flower run", "none; a constant 0 with --dp-train, and from "
                "privfedcal's ClientApp with --hide-counts",
                "public without --dp-train and --hide-counts (FedAvg weights); carries "
                "nothing with either from privfedcal's ClientApp. The Flower plugin's node "
                "reports its size whatever the settings (its server plans the release and "
                "the clip search with it): under hide-counts it is public, and with a "
                "cohort's summed counts it can split them"),
    # flower.hold: keeps a SuperNode busy between messages (flower/link.py)
    ClientField("query.hold", "-", "-", "nothing: an empty reply, sent after waiting the "
                "seconds the server asked for", "flower.hold > 0, after every reply", "none",
                "public: no record; when it comes is the server's requested wait after the "
                "node's previous reply, whose time the server sees anyway (timing is not "
                "covered, below); `summary.json` counts those that came before the node's "
                "next message (`flower_holds.missed`)"),
    # error replies (Flower's Error), of any message: a code, never the error's text
    ClientField("*", "error", "code", "Flower's error code (int): 2 from privfedcal's "
                "ClientApp; 1, 7 or 8 from the SuperNode itself (the app did not load, its "
                "FAB failed verification, the ClientApp process stopped)",
                "a message the node could not answer", "none",
                "public: which of Flower's fixed cases failed", values=_FLOWER_ERROR_CODES),
    ClientField("*", "error", "reason", "one code of `privacy/error_codes.py`, from the "
                f"error's class only: {_CODES_HELD}. The full error stays in the node's log. "
                "The SuperNode's own replies carry Flower's fixed texts (" +
                ", ".join(f'"{r}"' for r in _FLOWER_REASONS) + "); one of Flower's is free "
                "text, outside the ClientApp: an error installing the app's FAB or its "
                "dependencies, before the app runs, is sent as its class and text",
                "a message the node could not answer", "none: a fixed vocabulary, never "
                "the error's text",
                "public: a few bits per failure; which code, like whether the node fails at "
                "all (a dropped reply the server sees anyway), can depend on the data "
                "(`out-of-memory`, `diverged`) and is not charged; `summary.json` keeps only "
                "the code (`dropped_clients[].reason`)", values=CODES + _FLOWER_REASONS),
)

def transcript_field(label: str, view: str) -> str | None:
    """How a transcript entry appears among the client's fields: the field of the tensors
    an entry of ``label`` seen as ``view`` records (None: no client sent them). A model
    update is the train reply's state; every other release is a calibration payload (a
    payload task's reply, whatever its label); a decrypted sum is the key holder's."""
    if view == "aggregate":
        return "query.decrypt/aggregate/*"
    if label == QUANTILE_RELEASE:  # the Flower plugin's clip search (dp-clip = "auto")
        return "query.clip/histogram/counts"
    if view == "plain-upload":
        return "train/local/*" if label == UPDATE_RELEASE else "query.payload/payload"
    return None


#: transcript entry keys that carry what a client sent (the rest is the server's own
#: bookkeeping or the public config: round, label, view, client, file, recipe, ...)
TRANSCRIPT_ENTRY_KEYS: dict[str, str] = {
    "weight": "train/metrics/num-examples",
    "bytes": "query.payload/ciphertext/data",
}


#: who sends a release, by ``ReleaseSpec.participants``
_SENDERS = {"all": "after training, every client", "selected": "each round, its selected clients"}
#: the fixed field the payload's keys follow in the table
_PAYLOAD_AFTER = "query.payload/meta/partition-id"


def payload_fields(releases: Sequence[ReleaseSpec],
                   attacks: Mapping[str, Sequence[str]] | None = None
                   ) -> tuple[ClientField, ...]:
    """One field per payload key of the declared ``releases``, in order of first
    declaration; releases that share a key share its row. Every declared key has an L2
    sensitivity (``ReleaseSpec`` refuses a key without one), so each is DP-noised with
    --dp-eps and charged; without DP it is what the attacks read (``attacks``: release
    label -> the names of the attacks on it)."""
    attacks = attacks or {}
    by_key: dict[str, list[ReleaseSpec]] = {}
    for r in releases:
        for k in r.keys:
            by_key.setdefault(k, []).append(r)
    fields = []
    for key, rs in by_key.items():
        missing = [r.label for r in rs if key not in r.holds]
        if missing:
            raise ValueError(f"release(s) {', '.join(missing)} do not say what payload key "
                             f"{key!r} holds (ReleaseSpec.holds)")
        readers = dict.fromkeys(f"`attack invert --{a}`" for r in rs
                                for a in attacks.get(r.label, ()))
        fields.append(ClientField(
            "query.payload", "payload", key,
            "; ".join(f"{r.label}: {r.holds[key]}" for r in rs),
            " / ".join(f"{r.label} ({_SENDERS[r.participants]})" for r in rs)
            + " without --secagg",
            "DP with --dp-eps (L2 sensitivity "
            + ", ".join(f"{r.sensitivity[key]}" if len(rs) == 1 else
                        f"{r.label} {r.sensitivity[key]}" for r in rs) + ")",
            "charged with --dp-eps; without DP unprotected (read by "
            + ", ".join(["`attack classes`", *readers]) + ")"))
    return tuple(fields)


def client_fields(releases: Sequence[ReleaseSpec],
                  attacks: Mapping[str, Sequence[str]] | None = None
                  ) -> tuple[ClientField, ...]:
    """Every field a client may send: the fixed ones and the declared releases' payload
    keys (after the payload message's own meta field)."""
    at = [f.name for f in FIXED_FIELDS].index(_PAYLOAD_AFTER) + 1
    return FIXED_FIELDS[:at] + payload_fields(releases, attacks) + FIXED_FIELDS[at:]


def declared(message: str, record: str, key: str, releases: Sequence[ReleaseSpec],
             attacks: Mapping[str, Sequence[str]] | None = None) -> ClientField | None:
    """The declaration of ``message/record/key`` (``*`` declarations match any key) among
    the fixed fields and the payload keys of ``releases``."""
    for f in client_fields(releases, attacks):
        if f.message in (message, "*") and f.record == record and f.key in (key, "*"):
            return f
    return None


def markdown_table(releases: Sequence[ReleaseSpec],
                   attacks: Mapping[str, Sequence[str]] | None = None) -> str:
    """The table of ``docs/threat-model.md`` (``attacks``: as ``payload_fields``)."""
    rows = ["| field | holds | sent when | protection | budget |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{f.name}` | {f.holds} | {f.flag} | {f.protection} | {f.budget} |"
             for f in client_fields(releases, attacks)]
    return "\n".join(rows)


__all__ = ["FIXED_FIELDS", "ClientField", "client_fields", "declared", "markdown_table",
           "payload_fields", "transcript_field"]
