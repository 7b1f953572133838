"""Why an upload was dropped or a release not made, as the server records it: declared codes.

A record in the server's folder is a release too: the text of a failed check can hold what
the check had at hand (a decrypted sum's largest entry, a shape, a loss). So
``summary.json``'s ``rejected_uploads`` and ``skipped_releases``, and the notes a skipped
release leaves, carry one of these codes and, where a release needs one, public numbers
only (``PUBLIC_NUMBERS``: how many uploads arrived and the public minimum). The detailed
text goes to the experimenter's log (the ``privfedcal`` loggers), never to ``server/``.
``privacy/error_codes.py`` is the vocabulary of what a Flower node sends about its own
errors; these are the server's words about a release, and a node's code maps onto one
(``from_node_code``).

Which code a record holds can depend on the data (a client whose payload overflows the CKKS
parameters, a sum past its bound): a few bits per failure, outside the budget, like the
dropped reply itself (docs/threat-model.md).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Why an upload was dropped or a release was not made."""

    MALFORMED = "malformed-upload"
    INVALID_CIPHERTEXT = "invalid-ciphertext"
    CKKS_OVERFLOW = "payload-exceeds-ckks"
    REFUSED_BY_CLIENT = "refused-by-client"
    COHORT_INCOMPLETE = "cohort-incomplete"
    NO_VALID_UPLOAD = "no-valid-upload"
    TOO_FEW_UPLOADS = "too-few-uploads"
    BOUND_EXCEEDED = "aggregate-exceeds-bound"
    KEY_HOLDER_REFUSED = "key-holder-refused"
    WEIGHT_NOT_POSITIVE = "weight-sum-not-positive"
    WITHHELD_ISOLATING = "withheld-isolating"
    DUPLICATE_UPLOAD = "duplicate-upload"
    UNNAMED = "unnamed"


#: what each code means (the docs table and the declared rows of ``summary.json``)
MEANING: dict[Reason, str] = {
    Reason.MALFORMED: "an upload that is not a payload of finite tensors shaped like the "
                      "others, or a plaintext or badly padded one where a ciphertext was due",
    Reason.INVALID_CIPHERTEXT: "a ciphertext that does not deserialise under the release's "
                               "key, is not fresh at its level and scale, has another "
                               "layout, or cannot be added",
    Reason.CKKS_OVERFLOW: "the client's payload does not fit the release's CKKS parameters "
                          "(the client could not encrypt it)",
    Reason.REFUSED_BY_CLIENT: "the client's own ledger refused the release (its planned "
                              "count is reached)",
    Reason.COHORT_INCOMPLETE: "another upload of the client's cohort is missing or was "
                              "rejected: the whole cohort is left out of the sum",
    Reason.NO_VALID_UPLOAD: "no upload of the release was valid",
    Reason.TOO_FEW_UPLOADS: "fewer uploads than the public minimum of a secure sum "
                            "(--secagg-min-clients) arrived or survived the checks",
    Reason.BOUND_EXCEEDED: "the decrypted sum failed the key holder's magnitude check "
                           "against the declared public bound",
    Reason.KEY_HOLDER_REFUSED: "the key holder's node refused to decrypt the sum (a Flower "
                               "node sends only its code)",
    Reason.WEIGHT_NOT_POSITIVE: "the decrypted sum of the model updates' weights is not "
                                "positive",
    Reason.WITHHELD_ISOLATING: "the whole-run check on the sum's actual contributors failed: "
                               "releasing it would single out a group smaller than the "
                               "minimum, so it is withheld",
    Reason.DUPLICATE_UPLOAD: "a second upload of one client to one release: never summed",
    Reason.UNNAMED: "a reason given as text where a code was due (its text is in the log "
                    "only; tests/privacy/test_server_records.py fails on such a call)",
}

#: the numbers a record may carry beside its code, each public: the server counts the
#: uploads it received, and the minimum is a setting in config.json
PUBLIC_NUMBERS = ("uploads", "min_clients")

#: a node's error code (privacy/error_codes.py) -> the server's reason for the release
_NODE_CODES = {"upload-rejected-locally": Reason.KEY_HOLDER_REFUSED}


def reason_of(cause: Reason | str | BaseException, default: Reason = Reason.MALFORMED
              ) -> Reason:
    """The code of ``cause``: a code as given, an exception's declared ``reason`` (set where
    it is raised; ``default`` where none is). Free text is never a code: ``UNNAMED``."""
    if isinstance(cause, BaseException):
        cause = getattr(cause, "reason", None) or default
    try:
        return Reason(str(cause))
    except ValueError:
        return Reason.UNNAMED


def from_node_code(code: str) -> Reason:
    """The release reason for the error code a key holder's node sent."""
    return _NODE_CODES.get(code, Reason.KEY_HOLDER_REFUSED)


def record(round_: int, label: str, reason: Reason, *, client: int | None = None,
           **public: int) -> dict[str, Any]:
    """One ``rejected_uploads`` (with ``client``) or ``skipped_releases`` entry."""
    unknown = sorted(set(public) - set(PUBLIC_NUMBERS))
    if unknown:
        raise ValueError(f"undeclared number(s) {unknown} in a release record; declared: "
                         f"{', '.join(PUBLIC_NUMBERS)}")
    out: dict[str, Any] = {"round": int(round_), "label": str(label)}
    if client is not None:
        out["client"] = int(client)
    return {**out, "reason": Reason(reason).value, **{k: int(v) for k, v in public.items()}}


CODES: tuple[str, ...] = tuple(r.value for r in Reason)

__all__ = ["CODES", "MEANING", "PUBLIC_NUMBERS", "Reason", "from_node_code", "reason_of",
           "record"]
