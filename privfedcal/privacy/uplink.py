"""The uplink every calibration payload goes through: bound -> noise -> encrypt.

Client side, each stage is optional: ``bound`` clips per-sample rows before they are summed
(inside the payload task), ``noise`` adds calibrated Gaussian noise, ``encrypt`` turns the
payload into CKKS ciphertexts. Server side, the uplink adds what arrives and hands the
calibrator the sum alone; the calibrator cannot tell which stages ran.

This module holds the plaintext pipeline; the protected stages plug in through
``UplinkStage`` objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from privfedcal.errors import UploadRejected
from privfedcal.federation.hooks import Bound, NoBound, Payload
from privfedcal.federation.transcript import Transcript

log = logging.getLogger("privfedcal.uplink")


def validate_upload(payload: Payload, reference: Payload | None) -> None:
    """Reject malformed uploads: non-tensors, NaN/Inf, keys or shapes unlike the others."""
    for k, v in payload.items():
        if not isinstance(v, Tensor):
            raise UploadRejected(f"{k!r} is not a tensor")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise UploadRejected(f"{k!r} contains NaN or Inf")
    if reference is not None:
        if set(payload) != set(reference):
            raise UploadRejected(f"keys {sorted(payload)} differ from {sorted(reference)}")
        for k, v in payload.items():
            if v.shape != reference[k].shape:
                raise UploadRejected(f"{k!r} has shape {tuple(v.shape)}, expected "
                                     f"{tuple(reference[k].shape)}")


def payload_bytes(payload: Payload) -> int:
    return int(sum(v.numel() * v.element_size() for v in payload.values()))


@dataclass
class Uplink:
    """Plaintext uplink (no protection): the server sees every client's payload."""

    bound: Bound = field(default_factory=NoBound)
    rejected: list[dict] = field(default_factory=list)

    def aggregate(self, uploads: list[tuple[int, Payload]], *, round_: int, label: str,
                  transcript: Transcript) -> Payload:
        total: Payload | None = None
        reference: Payload | None = None
        for client, payload in uploads:
            try:
                validate_upload(payload, reference)
            except UploadRejected as exc:
                log.warning("round %d %s: upload of client %d rejected: %s", round_, label,
                            client, exc)
                self.rejected.append({"round": round_, "label": label, "client": client,
                                      "reason": str(exc)})
                continue
            reference = reference or payload
            transcript.record(round_=round_, label=label, view="plain-upload", client=client,
                              tensors=payload, bytes=payload_bytes(payload))
            if total is None:
                total = {k: v.detach().clone() for k, v in payload.items()}
            else:
                for k, v in payload.items():
                    total[k] += v
        if total is None:
            raise UploadRejected(f"round {round_} {label}: no valid upload")
        return total


def build_uplink(cfg, exp) -> Uplink:
    """The uplink a configuration asks for."""
    from privfedcal.errors import UsageError

    if cfg.dp_enabled or cfg.secagg or cfg.hide_counts or cfg.dp_train:
        raise UsageError("upload protections (--dp-eps, --secagg, --hide-counts, --dp-train) "
                         "are not available in this build yet")
    return Uplink()
