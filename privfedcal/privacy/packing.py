"""Flatten a calibration payload (dict of named sum tensors) into one float64 vector.

Secure aggregation (``secagg.py``) encrypts vectors, not dicts, so every client and the key
holder must agree on one deterministic layout: keys in sorted order, each flattened in
row-major order. Keys declared *symmetric* (a release's ``ReleaseSpec.symmetric``, e.g. CCVR's
per-class second moments sum_i z_i z_i^T, shape (C, d, d)) contribute only the upper triangle of their last
two dimensions, diagonal included: d(d+1)/2 instead of d^2 numbers, which halves the
ciphertext bytes of such statistics. ``unpack`` mirrors them back.

``pack`` is the client-side gate of the uplink: a payload with missing/extra keys, a wrong
shape, NaN/Inf or an asymmetric "symmetric" entry raises ``UploadRejected`` with a reason.

``EncryptedUpload`` is the wire frame of one encrypted upload: a safetensors file whose
uint8 tensors are the ciphertext chunks and whose metadata names the key, the layout (by
``PayloadLayout.digest``), the chunk count and a SHA-256 over all of them (never pickle).
``from_bytes`` validates untrusted bytes strictly and raises ``UploadRejected`` on anything
else. The digest catches truncation and corruption in transit, not a malicious sender, who
can recompute it (that needs authenticated transport).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import safetensors.numpy
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
        cls, example: Mapping[str, Tensor], symmetric: Iterable[str] = frozenset()
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


UPLOAD_FORMAT = "privfedcal.encrypted-upload/1"
# A frame's header lists ~80 bytes per chunk; 4 MiB covers ~50,000 chunks (~200 million
# packed values at N = 8192) and bounds what a hostile header can make the parser read.
MAX_HEADER_BYTES = 1 << 22
_META_KEYS = frozenset({"format", "key_id", "layout_hash", "chunks", "sha256"})


def _chunk_name(i: int) -> str:
    return f"chunk{i:06d}"


def _frame_digest(key_id: str, layout_hash: str, chunks: tuple[bytes, ...]) -> str:
    """SHA-256 over the ids, the chunk lengths and the chunk bytes, in order."""
    h = hashlib.sha256(json.dumps([UPLOAD_FORMAT, key_id, layout_hash,
                                   [len(c) for c in chunks]]).encode())
    for c in chunks:
        h.update(c)
    return h.hexdigest()


@dataclass(frozen=True)
class EncryptedUpload:
    """One client's encrypted payload: chunks are serialised ``ts.CKKSVector`` objects."""

    key_id: str
    layout_hash: str
    chunks: tuple[bytes, ...]

    def to_bytes(self) -> bytes:
        """A safetensors file: chunk ``i`` is the uint8 tensor ``chunk{i:06d}``; its
        ``__metadata__`` holds the format, ``key_id``, ``layout_hash``, the chunk count and
        the SHA-256 of all of them (``_frame_digest``)."""
        for what, s in (("key id", self.key_id), ("layout hash", self.layout_hash)):
            if not (isinstance(s, str) and s.isascii()):
                raise UsageError(f"encrypted upload: {what} must be an ASCII string")
        chunks = tuple(bytes(c) for c in self.chunks)
        meta = {"format": UPLOAD_FORMAT, "key_id": self.key_id,
                "layout_hash": self.layout_hash, "chunks": str(len(chunks)),
                "sha256": _frame_digest(self.key_id, self.layout_hash, chunks)}
        tensors = {_chunk_name(i): np.frombuffer(c, dtype=np.uint8)
                   for i, c in enumerate(chunks)}
        return safetensors.numpy.save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptedUpload:
        """Parse untrusted bytes. Anything but a frame written by ``to_bytes`` (a header
        over ``MAX_HEADER_BYTES``, other tensors, dtypes, shapes or metadata, offsets that
        safetensors refuses, a digest mismatch) raises ``UploadRejected``; nothing is
        unpickled, and no tensor is allocated beyond the bytes received."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UploadRejected(f"encrypted upload: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < 8:
            raise UploadRejected("encrypted upload: shorter than a safetensors header")
        n = int.from_bytes(data[:8], "little")
        if n > MAX_HEADER_BYTES or 8 + n > len(data):
            raise UploadRejected(f"encrypted upload: header of {n} bytes is oversized or "
                                 f"truncated ({len(data)} bytes received)")
        try:
            header = json.loads(data[8 : 8 + n])
        except (ValueError, RecursionError) as exc:
            raise UploadRejected(f"encrypted upload: header is not JSON ({exc})") from None
        meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
        if not isinstance(meta, dict) or set(meta) != _META_KEYS \
                or not all(isinstance(v, str) for v in meta.values()):
            raise UploadRejected(f"encrypted upload: metadata must hold exactly "
                                 f"{sorted(_META_KEYS)} as strings")
        if meta["format"] != UPLOAD_FORMAT:
            raise UploadRejected(f"encrypted upload: unknown format {meta['format'][:64]!r}")
        count = meta["chunks"]
        if not (count.isascii() and count.isdigit() and len(count) <= 9) \
                or int(count) != len(header):
            raise UploadRejected(f"encrypted upload: metadata says {count[:16]!r} chunks, "
                                 f"header lists {len(header)} tensors")
        if set(header) != {_chunk_name(i) for i in range(len(header))}:
            raise UploadRejected("encrypted upload: tensor names are not chunk000000, ...")
        for name, info in header.items():
            if not isinstance(info, dict) or info.get("dtype") != "U8" \
                    or not isinstance(info.get("shape"), list) or len(info["shape"]) != 1:
                raise UploadRejected(f"encrypted upload: {name} is not a 1-d uint8 tensor")
        try:
            arrays = safetensors.numpy.load(data)
        except Exception as exc:  # safetensors' own checks: offsets, sizes, overlaps
            raise UploadRejected(f"encrypted upload: malformed safetensors ({exc})") from None
        chunks = tuple(arrays[_chunk_name(i)].tobytes() for i in range(len(header)))
        if _frame_digest(meta["key_id"], meta["layout_hash"], chunks) != meta["sha256"]:
            raise UploadRejected("encrypted upload: digest mismatch (truncated or corrupted)")
        return cls(meta["key_id"], meta["layout_hash"], chunks)
