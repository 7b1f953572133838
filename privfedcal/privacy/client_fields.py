"""Every field a client sends, declared once: what it holds, which flag makes it, what
protects it, and whether it is charged to the privacy budget or public by declaration.

The same fields leave a client in the simulator (as Python objects that the server side
records in ``transcript/`` and ``clients.jsonl``) and under Flower (as reply records).
``docs/threat-model.md`` prints this table (``markdown_table``) and
``tests/privacy/test_client_fields.py`` walks the real messages of runs with every
protection on, in the simulator and over Flower's wire, and fails on any field that is not
declared here. A field is named ``message/record/key`` after its Flower reply; ``*`` stands
for every key of a model state or of a payload.
"""

from __future__ import annotations

from dataclasses import dataclass

from privfedcal.privacy.releases import UPDATE_RELEASE

# The calibration releases' labels appear below only in the texts of the table
# (docs/threat-model.md): privacy/ sits below the calibrators that declare them
# (calibration/ccvr.py, creff.py), and tests/privacy/test_client_fields.py checks every field
# of a real run's messages against this table, so a new release's payload keys are listed
# here as they reach the wire.
CCVR_RELEASE, CREFF_RELEASE = "ccvr-stats", "creff-grad"

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

    @property
    def name(self) -> str:
        return f"{self.message}/{self.record}/{self.key}"


_META = "node's partition index (int)"
_ID = "public: the server addresses nodes by id and names participants in the transcript"

CLIENT_FIELDS: tuple[ClientField, ...] = (
    # local training
    ClientField("train", "meta", "partition-id", _META, "always", "none", _ID),
    ClientField("train", "local", "*", "model state after local training (the model's shapes)",
                "always", "none; DP-SGD with --dp-train",
                "public without --dp-train (the summary says the guarantee covers the "
                "calibration uploads only); charged with --dp-train"),
    ClientField("train", "metrics", "num-examples", "client size n_k (int)", "always",
                "none; a constant 0 with --dp-train",
                "public without --dp-train (FedAvg weights); carries nothing with --dp-train"),
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
    ClientField("query.payload", "payload", "count", "CCVR: per-class counts (C,); CReFF "
                "--creff-weighting sample: per-class counts (C,)",
                f"{CCVR_RELEASE} / {CREFF_RELEASE} without --secagg", "DP with --dp-eps",
                "charged with --dp-eps; without DP unprotected (what `attack classes` reads)"),
    ClientField("query.payload", "payload", "sum", "CCVR: per-class feature sums (C, d)",
                f"{CCVR_RELEASE} without --secagg", "DP with --dp-eps",
                "charged with --dp-eps; without DP unprotected (`attack invert --stats`)"),
    ClientField("query.payload", "payload", "outer", "CCVR: per-class sums of z z^T (C, d, d)",
                f"{CCVR_RELEASE} without --secagg", "DP with --dp-eps",
                "charged with --dp-eps; without DP unprotected (`attack invert --stats`)"),
    ClientField("query.payload", "payload", "grad", "CReFF: per-class classifier gradients "
                "(C, C, d+1)", f"{CREFF_RELEASE} without --secagg", "DP with --dp-eps",
                "charged with --dp-eps; without DP unprotected (`attack invert --gradients`)"),
    ClientField("query.payload", "payload", "holders", "CReFF: which classes the client holds "
                "(C,) of 0/1", f"{CREFF_RELEASE} without --secagg", "DP with --dp-eps",
                "charged with --dp-eps; without DP unprotected (`attack classes`)"),
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
    ClientField("query.decrypt", "rejected", "reason", "why the key holder refused to decrypt "
                "(text)", "--secagg, key holder", "none",
                "public: the outcome of a check on public facts (parameters, count) or on the "
                "sum's magnitude bound"),
    # discovery
    ClientField("query.hello", "meta", "partition-id", _META, "start of a Flower run", "none",
                _ID),
    ClientField("query.hello", "meta", "num-partitions", "number of clients (int)",
                "start of a Flower run", "none", "public: in the run config"),
    ClientField("query.hello", "meta", "settings", "a 16-hex digest of the run's public data "
                "settings (dataset, partition scheme and its parameters, clients)",
                "start of a Flower run", "none",
                "public: a function of the public run config only, never of the data seed"),
    ClientField("query.hello", "metrics", "num-examples", "client size n_k (int)",
                "start of a Flower run", "none; a constant 0 with --dp-train",
                "public without --dp-train (FedAvg weights); carries nothing with --dp-train"),
)

def transcript_field(label: str, view: str) -> str | None:
    """How a transcript entry appears among the client's fields: the field of the tensors
    an entry of ``label`` seen as ``view`` records (None: no client sent them). A model
    update is the train reply's state; every other release is a calibration payload (a
    payload task's reply, whatever its label); a decrypted sum is the key holder's."""
    if view == "aggregate":
        return "query.decrypt/aggregate/*"
    if view == "plain-upload":
        return "train/local/*" if label == UPDATE_RELEASE else "query.payload/payload"
    return None


#: transcript entry keys that carry what a client sent (the rest is the server's own
#: bookkeeping or the public config: round, label, view, client, file, recipe, ...)
TRANSCRIPT_ENTRY_KEYS: dict[str, str] = {
    "weight": "train/metrics/num-examples",
    "bytes": "query.payload/ciphertext/data",
}


def declared(message: str, record: str, key: str) -> ClientField | None:
    """The declaration of ``message/record/key`` (``*`` declarations match any key)."""
    for f in CLIENT_FIELDS:
        if f.message == message and f.record == record and f.key in (key, "*"):
            return f
    return None


def markdown_table() -> str:
    """The table of ``docs/threat-model.md``."""
    rows = ["| field | holds | sent when | protection | budget |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{f.name}` | {f.holds} | {f.flag} | {f.protection} | {f.budget} |"
             for f in CLIENT_FIELDS]
    return "\n".join(rows)


__all__ = ["CLIENT_FIELDS", "ClientField", "declared", "markdown_table", "transcript_field"]


if __name__ == "__main__":  # regenerate the table of docs/threat-model.md
    print(markdown_table())
