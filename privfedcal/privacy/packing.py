"""Flatten a calibration payload (dict of named sum tensors) into one float64 vector.

Secure aggregation (``secagg.py``) encrypts vectors, not dicts, so every client and the key
holder must agree on one deterministic layout: keys in sorted order, each flattened in
row-major order. Keys declared *symmetric* (CCVR's per-class second moments
``outer`` = sum_i z_i z_i^T, shape (C, d, d)) contribute only the upper triangle of their last
two dimensions, diagonal included: d(d+1)/2 instead of d^2 numbers, which halves the
ciphertext bytes of CCVR statistics. ``unpack`` mirrors them back.

``pack`` is the client-side gate of the uplink: a payload with missing/extra keys, a wrong
shape, NaN/Inf or an asymmetric "symmetric" entry raises ``UploadRejected`` with a reason.

``EncryptedUpload`` is the wire frame of one encrypted upload (magic header, length-prefixed
fields, SHA-256 trailer; never pickle): its digest catches truncation and corruption in
transit, not a malicious sender, who can recompute it (that needs authenticated transport).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from privfedcal.errors import UploadRejected, UsageError

_FORMAT = "privfedcal.payload-layout/1"
# Relative tolerance for "symmetric" entries: float32 Z^T Z is symmetric up to rounding.
_SYM_RTOL = 1e-5


@dataclass(frozen=True)
class LayoutEntry:
    """One named tensor of a payload: its shape and whether only the upper triangle travels."""

    name: str
    shape: tuple[int, ...]
    symmetric: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise UsageError("payload layout: empty key name")
        if any(int(s) < 0 for s in self.shape):
            raise UsageError(f"payload layout: negative dimension in shape of {self.name!r}")
        if self.symmetric and (len(self.shape) < 2 or self.shape[-1] != self.shape[-2]):
            raise UsageError(
                f"payload layout: symmetric key {self.name!r} needs square last two dims, "
                f"got shape {tuple(self.shape)}"
            )

    @property
    def size(self) -> int:
        """Number of packed values."""
        if self.symmetric:
            d = self.shape[-1]
            return math.prod(self.shape[:-2]) * d * (d + 1) // 2
        return math.prod(self.shape)


@dataclass(frozen=True)
class PayloadLayout:
    """A deterministic flattening of payload dicts; the same object packs and unpacks."""

    entries: tuple[LayoutEntry, ...]

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if names != sorted(names) or len(set(names)) != len(names):
            raise UsageError("payload layout: keys must be unique and sorted")

    @classmethod
    def from_payload(
        cls, example: Mapping[str, Tensor], symmetric: Iterable[str] = frozenset({"outer"})
    ) -> PayloadLayout:
        """Layout of ``example``; keys in ``symmetric`` that are present pack their upper
        triangle (keys absent from ``example`` are ignored)."""
        if not example:
            raise UsageError("payload layout: empty payload")
        sym = set(symmetric)
        return cls(
            tuple(
                LayoutEntry(name, tuple(int(s) for s in example[name].shape), name in sym)
                for name in sorted(example)
            )
        )

    @cached_property
    def size(self) -> int:
        """Length of the packed vector."""
        return sum(e.size for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def pack(self, payload: Mapping[str, Tensor]) -> np.ndarray:
        """Validate ``payload`` against the layout and flatten it to float64."""
        missing = set(self.names) - set(payload)
        extra = set(payload) - set(self.names)
        if missing or extra:
            raise UploadRejected(
                f"payload keys differ from the layout: missing {sorted(missing)}, "
                f"extra {sorted(extra)}"
            )
        parts = []
        for e in self.entries:
            t = payload[e.name]
            if not isinstance(t, Tensor):
                raise UploadRejected(f"payload key {e.name!r} is not a tensor")
            if tuple(t.shape) != e.shape:
                raise UploadRejected(
                    f"payload key {e.name!r} has shape {tuple(t.shape)}, layout expects {e.shape}"
                )
            if t.is_complex():
                raise UploadRejected(f"payload key {e.name!r} is complex")
            x = t.detach().to("cpu", torch.float64)
            if not bool(torch.isfinite(x).all()):
                raise UploadRejected(f"payload key {e.name!r} contains NaN or Inf")
            if e.symmetric:
                x = self._upper(e, x)
            parts.append(x.reshape(-1))
        if not parts:
            return np.zeros(0, dtype=np.float64)
        return torch.cat(parts).numpy()

    def unpack(self, vector: np.ndarray | Tensor) -> dict[str, Tensor]:
        """Inverse of ``pack``: float64 tensors, symmetric keys mirrored to full matrices."""
        v = torch.as_tensor(np.asarray(vector, dtype=np.float64))
        if v.ndim != 1 or v.numel() != self.size:
            raise UploadRejected(
                f"packed vector has shape {tuple(v.shape)}, layout expects ({self.size},)"
            )
        out: dict[str, Tensor] = {}
        offset = 0
        for e in self.entries:
            chunk = v[offset : offset + e.size]
            offset += e.size
            if e.symmetric:
                d = e.shape[-1]
                rows, cols = torch.triu_indices(d, d)
                full = torch.zeros(math.prod(e.shape[:-2]), d, d, dtype=torch.float64)
                tri = chunk.reshape(-1, rows.numel())
                full[:, rows, cols] = tri
                full[:, cols, rows] = tri
                out[e.name] = full.reshape(e.shape)
            else:
                out[e.name] = chunk.reshape(e.shape).clone()
        return out

    @staticmethod
    def _upper(e: LayoutEntry, x: Tensor) -> Tensor:
        d = e.shape[-1]
        xt = x.transpose(-1, -2)
        scale = float(x.abs().max()) if x.numel() else 0.0
        if x.numel() and float((x - xt).abs().max()) > _SYM_RTOL * max(scale, 1.0):
            raise UploadRejected(f"payload key {e.name!r} is declared symmetric but is not")
        rows, cols = torch.triu_indices(d, d)
        return x.reshape(-1, d, d)[:, rows, cols]

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace): equal layouts give equal strings."""
        doc = {
            "format": _FORMAT,
            "entries": [
                {"name": e.name, "shape": list(e.shape), "symmetric": e.symmetric}
                for e in self.entries
            ],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PayloadLayout:
        try:
            doc = json.loads(text)
            if doc.get("format") != _FORMAT:
                raise UsageError(f"payload layout: unknown format {doc.get('format')!r}")
            entries = tuple(
                LayoutEntry(str(e["name"]), tuple(int(s) for s in e["shape"]), bool(e["symmetric"]))
                for e in doc["entries"]
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, UsageError):
                raise
            raise UsageError(f"payload layout: malformed JSON ({exc})") from exc
        return cls(entries)

    def digest(self) -> str:
        """SHA-256 of ``to_json()``: names the layout inside encrypted uploads."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


_MAGIC = b"PFCKKS\x01\n"


@dataclass(frozen=True)
class EncryptedUpload:
    """One client's encrypted payload: chunks are serialised ``ts.CKKSVector`` objects."""

    key_id: str
    layout_hash: str
    chunks: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def to_bytes(self) -> bytes:
        """Frame: magic, length-prefixed ids, chunk count, length-prefixed chunks, SHA-256."""
        parts = [_MAGIC]
        for s in (self.key_id, self.layout_hash):
            b = s.encode("ascii")
            parts += [struct.pack("<H", len(b)), b]
        parts.append(struct.pack("<I", len(self.chunks)))
        for c in self.chunks:
            parts += [struct.pack("<Q", len(c)), c]
        body = b"".join(parts)
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptedUpload:
        """Parse a frame; truncation, bad magic, trailing bytes or a bad digest are rejected."""
        data = bytes(data)
        if len(data) < len(_MAGIC) + 32 or not data.startswith(_MAGIC):
            raise UploadRejected("encrypted upload: bad magic header or too short")
        body, digest = data[:-32], data[-32:]
        if hashlib.sha256(body).digest() != digest:
            raise UploadRejected("encrypted upload: digest mismatch (truncated or corrupted)")
        pos = len(_MAGIC)

        def take(n: int) -> bytes:
            nonlocal pos
            if pos + n > len(body):
                raise UploadRejected("encrypted upload: truncated frame")
            pos += n
            return body[pos - n : pos]

        ids = [take(struct.unpack("<H", take(2))[0]).decode("ascii", "replace") for _ in range(2)]
        count = struct.unpack("<I", take(4))[0]
        chunks = tuple(take(struct.unpack("<Q", take(8))[0]) for _ in range(count))
        if pos != len(body):
            raise UploadRejected("encrypted upload: trailing bytes after the last chunk")
        return cls(ids[0], ids[1], chunks)
