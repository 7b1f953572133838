"""PayloadLayout (flatten payloads, upper triangle of symmetric keys) and the upload frame
(a safetensors file, validated strictly on arrival)."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest
import safetensors.numpy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.calibration.ccvr import CCVR
from privfedcal.errors import UploadRejected, UsageError
from privfedcal.privacy.packing import (
    MAX_HEADER_BYTES,
    UPLOAD_FORMAT,
    EncryptedUpload,
    PayloadLayout,
)

#: the keys CCVR declares symmetric (its ReleaseSpec): only their upper triangle is packed
CCVR_SYMMETRIC = CCVR.releases[0].symmetric


def ccvr_payload(c: int = 3, d: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(c, 5, d, generator=g)
    return {
        "count": torch.tensor([5.0] * c),
        "sum": z.sum(1),
        "outer": torch.einsum("cnd,cne->cde", z, z),
    }


def test_layout_order_sizes_and_golden_vector():
    p = {"b": torch.tensor([[1.0, 2.0], [2.0, 3.0]]), "a": torch.tensor([7.0, 8.0, 9.0])}
    lay = PayloadLayout.from_payload(p, symmetric={"b"})
    assert lay.names == ["a", "b"]
    # a flattened (3), then the upper triangle of b row-major: b00, b01, b11 (3).
    assert lay.size == 6
    np.testing.assert_array_equal(lay.pack(p), [7, 8, 9, 1, 2, 3])
    assert lay.pack(p).dtype == np.float64


def test_ccvr_sizes_upper_triangle():
    lay = PayloadLayout.from_payload(ccvr_payload(c=10, d=256), symmetric=CCVR_SYMMETRIC)
    assert lay.size == 10 + 10 * 256 + 10 * 256 * 257 // 2


def test_unpack_mirrors_symmetric_and_returns_float64():
    p = ccvr_payload()
    lay = PayloadLayout.from_payload(p, symmetric=CCVR_SYMMETRIC)
    out = lay.unpack(lay.pack(p))
    for k in p:
        assert out[k].dtype == torch.float64
        torch.testing.assert_close(out[k], p[k].double(), rtol=0, atol=0)
    torch.testing.assert_close(out["outer"], out["outer"].transpose(-1, -2), rtol=0, atol=0)


@st.composite
def payloads(draw):
    n_keys = draw(st.integers(1, 4))
    names = draw(
        st.lists(
            st.text("abcxyz_", min_size=1, max_size=6),
            min_size=n_keys,
            max_size=n_keys,
            unique=True,
        )
    )
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    payload, sym = {}, set()
    for name in names:
        if draw(st.booleans()):
            lead = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            d = draw(st.integers(1, 5))
            a = torch.randn((*lead, d, d), generator=g, dtype=torch.float64)
            payload[name] = a + a.transpose(-1, -2)
            sym.add(name)
        else:
            shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
            payload[name] = torch.randn(shape, generator=g, dtype=torch.float64)
    return payload, sym


@settings(max_examples=60, deadline=None)
@given(payloads())
def test_round_trip_and_json(case):
    payload, sym = case
    lay = PayloadLayout.from_payload(payload, symmetric=sym)
    vec = lay.pack(payload)
    assert vec.shape == (lay.size,)
    out = lay.unpack(vec)
    assert set(out) == set(payload)
    for k in payload:
        torch.testing.assert_close(out[k], payload[k], rtol=0, atol=0)
    again = PayloadLayout.from_json(lay.to_json())
    assert again == lay and again.digest() == lay.digest()


def test_rejections_have_reasons():
    p = ccvr_payload()
    lay = PayloadLayout.from_payload(p, symmetric=CCVR_SYMMETRIC)
    with pytest.raises(UploadRejected, match="missing"):
        lay.pack({k: v for k, v in p.items() if k != "sum"})
    with pytest.raises(UploadRejected, match="extra"):
        lay.pack({**p, "holders": torch.ones(3)})
    with pytest.raises(UploadRejected, match="shape"):
        lay.pack({**p, "sum": torch.ones(3, 5)})
    for bad in (float("nan"), float("inf")):
        s = p["sum"].clone()
        s[1, 2] = bad
        with pytest.raises(UploadRejected, match="NaN or Inf"):
            lay.pack({**p, "sum": s})
    asym = p["outer"].clone()
    asym[0, 0, 1] += 1.0
    with pytest.raises(UploadRejected, match="not symmetric|is not"):
        lay.pack({**p, "outer": asym})
    with pytest.raises(UploadRejected, match="expects"):
        lay.unpack(np.zeros(lay.size + 1))


def test_layout_validation():
    with pytest.raises(UsageError, match="square"):
        PayloadLayout.from_payload({"outer": torch.ones(2, 3)}, symmetric={"outer"})
    with pytest.raises(UsageError, match="malformed"):
        PayloadLayout.from_json("{not json")
    with pytest.raises(UsageError, match="format"):
        PayloadLayout.from_json('{"format": "x", "entries": []}')
    a = PayloadLayout.from_payload({"x": torch.ones(3)})
    b = PayloadLayout.from_payload({"x": torch.ones(4)})
    assert a.digest() != b.digest()


def test_frame_is_safetensors_with_metadata_and_round_trips():
    up = EncryptedUpload("k" * 32, "h" * 64, (b"abc", b"", b"\x00" * 10))
    raw = up.to_bytes()
    assert EncryptedUpload.from_bytes(raw) == up
    assert EncryptedUpload.from_bytes(bytearray(raw)) == up
    # an ordinary safetensors reader sees the chunks as uint8 tensors, the ids as metadata
    arrays = safetensors.numpy.load(raw)
    assert sorted(arrays) == ["chunk000000", "chunk000001", "chunk000002"]
    assert arrays["chunk000000"].dtype == np.uint8 and arrays["chunk000000"].tobytes() == b"abc"
    assert arrays["chunk000001"].shape == (0,) and arrays["chunk000002"].shape == (10,)
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    assert meta == {"format": UPLOAD_FORMAT, "key_id": "k" * 32, "layout_hash": "h" * 64,
                    "chunks": "3", "sha256": meta["sha256"]}
    # the digest is SHA-256 over the format, ids, chunk lengths, then the chunk bytes
    ref = hashlib.sha256(json.dumps([UPLOAD_FORMAT, "k" * 32, "h" * 64, [3, 0, 10]]).encode()
                         + b"abc" + b"\x00" * 10).hexdigest()
    assert meta["sha256"] == ref
    assert EncryptedUpload.from_bytes(EncryptedUpload("k", "h", ()).to_bytes()).chunks == ()
    with pytest.raises(UsageError, match="ASCII"):
        EncryptedUpload("\u00e9", "h", ()).to_bytes()


def _frame(meta: dict, tensors: dict) -> bytes:
    return safetensors.numpy.save(tensors, metadata=meta)


def test_frame_rejections_have_reasons():
    up = EncryptedUpload("k" * 32, "h" * 64, (b"abc", b"", b"\x00" * 10))
    raw = up.to_bytes()
    for bad in (raw[:-1], raw[:20], raw[:7], raw + b"\x00", b"XXXXXXXX" + raw[8:], b""):
        with pytest.raises(UploadRejected):
            EncryptedUpload.from_bytes(bad)
    flipped = bytearray(raw)
    flipped[-5] ^= 0x01  # inside the last chunk
    with pytest.raises(UploadRejected, match="digest"):
        EncryptedUpload.from_bytes(bytes(flipped))
    with pytest.raises(UploadRejected, match="expected bytes"):
        EncryptedUpload.from_bytes("text")  # type: ignore[arg-type]
    with pytest.raises(UploadRejected, match="oversized"):
        EncryptedUpload.from_bytes((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}")
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    chunks = {f"chunk{i:06d}": np.frombuffer(c, np.uint8) for i, c in enumerate(up.chunks)}
    with pytest.raises(UploadRejected, match="metadata must hold"):
        EncryptedUpload.from_bytes(_frame({**meta, "extra": "1"}, chunks))
    with pytest.raises(UploadRejected, match="metadata must hold"):
        EncryptedUpload.from_bytes(safetensors.numpy.save(chunks))
    with pytest.raises(UploadRejected, match="format"):
        EncryptedUpload.from_bytes(_frame({**meta, "format": "other/1"}, chunks))
    for count in ("2", "-3", "3.0", "\u0663", "9" * 5000):  # 5000 digits: past int()'s limit
        with pytest.raises(UploadRejected, match="chunks"):
            EncryptedUpload.from_bytes(_frame({**meta, "chunks": count}, chunks))
    with pytest.raises(UploadRejected, match="names"):
        EncryptedUpload.from_bytes(_frame(meta, {**{k: v for k, v in chunks.items()
                                                    if k != "chunk000001"}, "x": chunks["chunk000001"]}))
    with pytest.raises(UploadRejected, match="uint8"):
        EncryptedUpload.from_bytes(_frame(meta, {**chunks, "chunk000000": np.ones(3, np.float32)}))
    with pytest.raises(UploadRejected, match="uint8"):
        EncryptedUpload.from_bytes(_frame(meta, {**chunks,
                                                 "chunk000000": np.ones((1, 3), np.uint8)}))
    with pytest.raises(UploadRejected, match="digest"):
        EncryptedUpload.from_bytes(_frame({**meta, "key_id": "j" * 32}, chunks))
    # a pickle is refused before anything could unpickle it
    with pytest.raises(UploadRejected):
        EncryptedUpload.from_bytes(pickle.dumps(up))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_are_rejected_cleanly(data):
    with pytest.raises(UploadRejected):
        EncryptedUpload.from_bytes(data)


_UP = EncryptedUpload("k" * 64, "h" * 64, (b"\x01\x02\x03" * 20, b"", b"xyz"))
_RAW = _UP.to_bytes()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_frames_are_rejected_or_read_unchanged(data):
    """A flipped, cut, inserted or deleted byte anywhere never yields a different upload and
    never raises anything but UploadRejected (a flip in header padding may leave it valid)."""
    raw = bytearray(_RAW)
    kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete", "header-length"]))
    pos = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        raw[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        del raw[pos:]
    elif kind == "insert":
        raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    elif kind == "delete":
        del raw[pos]
    else:
        raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    try:
        assert EncryptedUpload.from_bytes(bytes(raw)) == _UP
    except UploadRejected:
        pass


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=20), max_size=6),
       st.dictionaries(st.text(min_size=1, max_size=12),
                       st.tuples(st.sampled_from([np.uint8, np.float32, np.int64]),
                                 st.lists(st.integers(0, 3), max_size=3)), max_size=4))
def test_well_formed_foreign_safetensors_are_rejected(meta, specs):
    tensors = {k: np.zeros(shape, dtype) for k, (dtype, shape) in specs.items()}
    with pytest.raises(UploadRejected):
        EncryptedUpload.from_bytes(safetensors.numpy.save(tensors, metadata=meta or None))


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(max_codepoint=127), max_size=80),
       st.text(st.characters(max_codepoint=127), max_size=80),
       st.lists(st.binary(max_size=64), max_size=5))
def test_frame_round_trips(key_id, layout_hash, chunks):
    up = EncryptedUpload(key_id, layout_hash, tuple(chunks))
    assert EncryptedUpload.from_bytes(up.to_bytes()) == up


@settings(max_examples=80, deadline=None)
@given(st.fixed_dictionaries({"format": st.just(UPLOAD_FORMAT), "key_id": st.text(max_size=8),
                              "layout_hash": st.text(max_size=8),
                              "chunks": st.one_of(st.text(max_size=12),
                                                  st.integers(0, 3).map(str)),
                              "sha256": st.text(max_size=64)}),
       st.lists(st.binary(max_size=16), max_size=3))
def test_our_metadata_with_arbitrary_values_is_rejected(meta, chunks):
    """Right keys, arbitrary values: only a correct digest over these chunks gets through."""
    tensors = {f"chunk{i:06d}": np.frombuffer(c, np.uint8) for i, c in enumerate(chunks)}
    with pytest.raises(UploadRejected):
        EncryptedUpload.from_bytes(safetensors.numpy.save(tensors, metadata=meta))
