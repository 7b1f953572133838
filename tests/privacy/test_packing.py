"""PayloadLayout (flatten payloads, upper triangle of symmetric keys) and the upload frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.errors import UploadRejected, UsageError
from privfedcal.privacy.packing import EncryptedUpload, PayloadLayout


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
    lay = PayloadLayout.from_payload(ccvr_payload(c=10, d=256))
    assert lay.size == 10 + 10 * 256 + 10 * 256 * 257 // 2


def test_unpack_mirrors_symmetric_and_returns_float64():
    p = ccvr_payload()
    lay = PayloadLayout.from_payload(p)
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
    lay = PayloadLayout.from_payload(p)
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
        PayloadLayout.from_payload({"outer": torch.ones(2, 3)})
    with pytest.raises(UsageError, match="malformed"):
        PayloadLayout.from_json("{not json")
    with pytest.raises(UsageError, match="format"):
        PayloadLayout.from_json('{"format": "x", "entries": []}')
    a = PayloadLayout.from_payload({"x": torch.ones(3)})
    b = PayloadLayout.from_payload({"x": torch.ones(4)})
    assert a.digest() != b.digest()


def test_frame_round_trip_and_rejections():
    up = EncryptedUpload("k" * 32, "h" * 64, (b"abc", b"", b"\x00" * 10))
    raw = up.to_bytes()
    assert EncryptedUpload.from_bytes(raw) == up
    assert up.nbytes == 13
    for bad in (raw[:-1], raw[:20], raw + b"\x00", b"XXXXXXXX" + raw[8:]):
        with pytest.raises(UploadRejected):
            EncryptedUpload.from_bytes(bad)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01
    with pytest.raises(UploadRejected, match="digest"):
        EncryptedUpload.from_bytes(bytes(flipped))
