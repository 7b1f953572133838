"""CKKS secure aggregation: parameters, correctness at the bound, roles, rejections."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tenseal as ts
import torch

from privfedcal.errors import UploadRejected, UsageError
from privfedcal.privacy.packing import EncryptedUpload, PayloadLayout
from privfedcal.privacy.secagg import (
    CKKSParams,
    KeyHolder,
    ServerAggregator,
    encrypt_payload,
    load_public_context,
)

C, D = 3, 4


def client_payload(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(C, 6, D, generator=g)
    return {
        "count": torch.tensor([6.0, 0.0, 6.0]),
        "sum": z.sum(1),
        "outer": torch.einsum("cnd,cne->cde", z, z),
    }


LAYOUT = PayloadLayout.from_payload(client_payload(0), symmetric={"outer"})  # as CCVR declares


@pytest.fixture(scope="module")
def holder() -> KeyHolder:
    return KeyHolder(CKKSParams.for_magnitude(1e3, 1e-6, max_clients=8))


def aggregate(holder: KeyHolder, payloads, **kw) -> dict[str, torch.Tensor]:
    agg = ServerAggregator(holder.public_context_bytes(), LAYOUT)
    for p in payloads:
        agg.add(encrypt_payload(p, LAYOUT, holder.public_context_bytes()).to_bytes())
    return holder.decrypt_aggregate(agg.result(), LAYOUT, n_clients=agg.count, **kw, flood_bits=None)



def wrap_bound(params: CKKSParams) -> float:
    """|aggregate entry| from which decryption silently wraps: q/2 / scale, with q the
    data-level modulus (all primes but the special one)."""
    return 2.0 ** (params.data_bits - 1 - params.scale_bits)

def test_for_magnitude_golden():
    # N=4096: scale = ceil(log2(1024 clients * 4 * 4096 / 1e-6)) = ceil(43.93) = 44;
    # data bits = 44 + ceil(log2 1e6)=20 + margin 4 = 68 -> two primes 34+34, special 24:
    # 92 <= 109 (128-bit bound for 4096).
    p = CKKSParams.for_magnitude(1e6, 1e-6)
    assert (p.poly_modulus_degree, p.coeff_mod_bit_sizes, p.scale_bits) == (4096, (34, 34, 24), 44)
    # 1e12: data bits 44 + 40 + 4 = 88, 88 + 24 = 112 > 109 -> N=8192, scale
    # ceil(log2(1024 * 4 * 8192 / 1e-6)) = ceil(44.93) = 45, data bits 45 + 40 + 4 = 89 = 45 + 44.
    p = CKKSParams.for_magnitude(1e12, 1e-6)
    assert (p.poly_modulus_degree, p.coeff_mod_bit_sizes, p.scale_bits) == (8192, (45, 44, 24), 45)
    assert p.error_bound(1024) <= 1e-6
    assert math.log2(p.max_abs_sum) <= p.data_bits - p.scale_bits - 4
    with pytest.raises(UsageError, match="no secure"):
        CKKSParams.for_magnitude(1e300, 1e-300)


def test_param_validation():
    with pytest.raises(UsageError, match="128-bit"):
        CKKSParams(4096, (60, 50), 40)
    with pytest.raises(UsageError, match="poly_modulus_degree"):
        CKKSParams(3000, (30, 24), 20)
    with pytest.raises(UsageError, match="scale_bits"):
        CKKSParams(4096, (30, 24), 30)
    with pytest.raises(UsageError, match="cannot hold"):
        CKKSParams(8192, (60, 40), 40, max_abs_sum=1e5)  # 60 - 40 - 4 = 16 bits < log2 1e5


@pytest.mark.parametrize("n_threads", [1, 2])
def test_three_clients_match_plaintext_sum(n_threads):
    holder = KeyHolder(CKKSParams.for_magnitude(1e3, 1e-6, max_clients=8, n_threads=n_threads))
    payloads = [client_payload(s) for s in (1, 2, 3)]
    agg = ServerAggregator(holder.public_context_bytes(), LAYOUT, n_threads=n_threads)
    for p in payloads:
        agg.add(encrypt_payload(p, LAYOUT, holder.public_context_bytes(), n_threads=n_threads))
    out = holder.decrypt_aggregate(agg.result(), LAYOUT, n_clients=3, flood_bits=None)
    for k in LAYOUT.names:
        want = sum(p[k].double() for p in payloads)
        err = (out[k] - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item() + 1e-9
        assert err <= holder.params.error_bound(3)
    torch.testing.assert_close(out["outer"], out["outer"].transpose(-1, -2), rtol=0, atol=0)


def test_sum_right_at_declared_bound():
    # Constant (and sign-alternating) slots are the worst case: the encoded coefficients
    # reach |x| * scale. Three clients, each a third of the declared maximum.
    m = 1e6
    holder = KeyHolder(CKKSParams.for_magnitude(m, 1e-3, max_clients=3))
    layout = PayloadLayout.from_payload({"v": torch.zeros(64)})
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(32)
    for pattern in (torch.ones(64, dtype=torch.float64), signs):
        agg = ServerAggregator(holder.public_context_bytes(), layout)
        for _ in range(3):
            agg.add(
                encrypt_payload({"v": pattern * (m / 3)}, layout, holder.public_context_bytes())
            )
        out = holder.decrypt_aggregate(agg.result(), layout, n_clients=3, flood_bits=None)["v"]
        assert out.abs().max().item() > m - 1e-3  # the sum really reaches the bound
        rel = ((out - pattern * m).abs() / m).max().item()
        assert rel <= 1e-4
        assert rel * m <= holder.params.error_bound(3)


def test_naive_two_prime_chain_wraps_silently():
    # [60, 40] at 2^40: the data level is the 60-bit prime q0, so |sum| * 2^40 must stay
    # below q0/2 ~ 2^59, i.e. |sum| < 2^19 = 524288. Past it, decryption returns garbage
    # and raises nothing: the reason for the rule data_bits >= scale + log2(max) + margin.
    params = CKKSParams(8192, (60, 40), 40)
    assert wrap_bound(params) == 2.0**19
    holder = KeyHolder(params)
    layout = PayloadLayout.from_payload({"v": torch.zeros(16)})

    def total(per_client: float) -> torch.Tensor:
        agg = ServerAggregator(holder.public_context_bytes(), layout)
        for _ in range(3):
            agg.add(
                encrypt_payload(
                    {"v": torch.full((16,), per_client)}, layout, holder.public_context_bytes()
                )
            )
        return holder.decrypt_aggregate(agg.result(), layout, n_clients=3, flood_bits=None)["v"]

    ok = total(1.6e5)  # 4.8e5 < 2^19
    assert (ok - 4.8e5).abs().max().item() <= 1e-4 * 4.8e5
    bad = total(2.0e5)  # 6.0e5 > 2^19: wraps to 6e5 - 2^20 ~ -4.5e5, no exception
    assert (bad - 6.0e5).abs().min().item() > 1e5
    # Each upload alone encodes fine (SEAL only refuses values past q0 itself): the
    # overflow exists only in the sum, so no client-side check can catch it.


def test_server_context_is_public_and_cannot_decrypt(holder):
    agg = ServerAggregator(holder.public_context_bytes(), LAYOUT)
    assert not agg.context.is_private()
    agg.add(encrypt_payload(client_payload(1), LAYOUT, holder.public_context_bytes()))
    vec = ts.ckks_vector_from(agg.context, agg.result()[0])
    with pytest.raises(ValueError):
        vec.decrypt()
    secret = holder.state_dict()["secret_context"]
    with pytest.raises(UsageError, match="secret key"):
        load_public_context(secret)
    with pytest.raises(UsageError, match="secret key"):
        ServerAggregator(secret, LAYOUT)


def test_foreign_key_rejected_and_forged_key_id_detected(holder):
    other = KeyHolder(holder.params)
    foreign = encrypt_payload(client_payload(1), LAYOUT, other.public_context_bytes())
    agg = ServerAggregator(holder.public_context_bytes(), LAYOUT)
    with pytest.raises(UploadRejected, match="key"):
        agg.add(foreign)
    # A forged key_id with the same parameters passes every server-side check (SEAL cannot
    # tell keys apart from a ciphertext); the sum then decrypts to garbage, which the key
    # holder detects through the declared magnitude bound.
    agg.add(encrypt_payload(client_payload(2), LAYOUT, holder.public_context_bytes()))
    agg.add(EncryptedUpload(holder.key_id, foreign.layout_hash, foreign.chunks))
    with pytest.raises(UploadRejected, match="exceeds the declared bound"):
        holder.decrypt_aggregate(agg.result(), LAYOUT, n_clients=2, flood_bits=None)
    # Under other parameters the forged upload does not even deserialise.
    big = KeyHolder(CKKSParams.for_magnitude(1e3, 1e-6, max_clients=8 * 2**20))
    assert big.params.coeff_mod_bit_sizes != holder.params.coeff_mod_bit_sizes
    forged = encrypt_payload(client_payload(1), LAYOUT, big.public_context_bytes())
    agg2 = ServerAggregator(holder.public_context_bytes(), LAYOUT)
    with pytest.raises(UploadRejected):
        agg2.add(EncryptedUpload(holder.key_id, forged.layout_hash, forged.chunks))


def test_truncated_tampered_and_malformed_uploads_rejected(holder):
    up = encrypt_payload(client_payload(1), LAYOUT, holder.public_context_bytes())
    raw = up.to_bytes()
    agg = ServerAggregator(holder.public_context_bytes(), LAYOUT)
    with pytest.raises(UploadRejected):
        agg.add(raw[: len(raw) // 2])
    tampered = bytearray(raw)
    tampered[len(raw) // 2] ^= 0x40
    with pytest.raises(UploadRejected, match="digest"):
        agg.add(bytes(tampered))
    # Valid frame around a truncated ciphertext (digest recomputed): SEAL's parser refuses.
    with pytest.raises(UploadRejected, match="deserialise"):
        agg.add(EncryptedUpload(up.key_id, up.layout_hash, (up.chunks[0][:-100],)))
    with pytest.raises(UploadRejected, match="chunks"):
        agg.add(EncryptedUpload(up.key_id, up.layout_hash, up.chunks * 2))
    with pytest.raises(UploadRejected, match="layout"):
        agg.add(EncryptedUpload(up.key_id, "0" * 64, up.chunks))
    # A ciphertext at another scale would be misread by the sum: not a fresh upload.
    ctx = load_public_context(holder.public_context_bytes())
    odd = ts.ckks_vector(ctx, [1.0] * LAYOUT.size, scale=2.0**20)
    with pytest.raises(UploadRejected, match="fresh"):
        agg.add(EncryptedUpload(up.key_id, up.layout_hash, (odd.serialize(),)))
    assert agg.count == 0
    agg.add(raw)  # the sum was untouched by the rejections
    out = holder.decrypt_aggregate(agg.result(), LAYOUT, n_clients=1, flood_bits=None)
    torch.testing.assert_close(out["sum"], client_payload(1)["sum"].double(), atol=1e-4, rtol=0)
    with pytest.raises(UploadRejected, match="chunks"):
        holder.decrypt_aggregate(agg.result() * 2, LAYOUT, n_clients=1, flood_bits=None)


def test_bound_breaking_upload_detected_at_decryption(holder):
    # Declared 1e3 with wrap bound 2^(data_bits-1-scale); an upload far past it wraps.
    big = {k: v * 0 + wrap_bound(holder.params) * 1.5 for k, v in client_payload(1).items()}
    big["outer"] = big["outer"] * 0  # keep it symmetric and simple
    with pytest.raises(UploadRejected, match="exceeds the declared bound"):
        aggregate(holder, [big])


def test_rounding_noise_and_n_clients(holder):
    payloads = [client_payload(s) for s in (1, 2)]
    plain = {k: sum(p[k].double() for p in payloads) for k in LAYOUT.names}
    out = aggregate(holder, payloads, round_to=1e-3)
    for k in LAYOUT.names:
        grid = out[k] / 1e-3
        torch.testing.assert_close(grid, grid.round(), atol=1e-6, rtol=0)
        assert (out[k] - plain[k]).abs().max().item() <= 0.5e-3 + holder.params.error_bound(2)
    with pytest.raises(UsageError, match="round_to"):
        aggregate(holder, payloads, round_to=holder.params.error_bound(2))
    with pytest.raises(UsageError, match="n_clients"):
        aggregate(holder, payloads * 5)  # 10 uploads > max_clients = 8
    with pytest.raises(UsageError, match="Generator"):
        aggregate(holder, payloads, noise=1.0)
    noisy = aggregate(holder, payloads, noise=0.5, generator=torch.Generator().manual_seed(7))
    drawn = 0.5 * torch.randn(
        LAYOUT.size, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    want = LAYOUT.unpack(LAYOUT.pack(plain) + drawn.numpy())
    for k in LAYOUT.names:
        torch.testing.assert_close(noisy[k], want[k], atol=1e-4, rtol=0)


def test_rotate_and_state_dict_resume():
    holder = KeyHolder(CKKSParams.for_magnitude(1e3, 1e-6, max_clients=8))
    old_public = holder.public_context_bytes()
    up = encrypt_payload(client_payload(1), LAYOUT, old_public)
    state = holder.state_dict()
    json.dumps({k: v for k, v in state.items() if not isinstance(v, bytes)})  # no pickle needed
    restored = KeyHolder.from_state_dict(state)
    assert restored.key_id == holder.key_id and restored.params == holder.params
    agg = ServerAggregator(restored.public_context_bytes(), LAYOUT)
    agg.add(up)
    out = restored.decrypt_aggregate(agg.result(), LAYOUT, n_clients=1, flood_bits=None)
    assert np.allclose(out["sum"].numpy(), client_payload(1)["sum"].numpy(), atol=1e-4)
    new_id = holder.rotate()
    assert new_id == holder.key_id != restored.key_id and holder.rotations == 1
    with pytest.raises(UploadRejected, match="key"):
        ServerAggregator(holder.public_context_bytes(), LAYOUT).add(up)
    with pytest.raises(UsageError, match="format"):
        KeyHolder.from_state_dict({"format": "pickle"})


def test_flooding_std_formula():
    """sigma_f = 2^(s/2) sqrt(L Q) error_bound(n), by hand."""
    from privfedcal.privacy.secagg import flooding_std

    p = CKKSParams.for_magnitude(1e3, 1e-10, max_clients=8)
    per_entry = 3 * 4.0 * p.poly_modulus_degree / 2.0**p.scale_bits
    assert flooding_std(p, 3, 100) == pytest.approx(2.0**20 * 10 * per_entry, rel=1e-12)
    assert flooding_std(p, 3, 100, bits=30, decryptions=4) == pytest.approx(
        2.0**15 * 20 * per_entry, rel=1e-12)


def test_two_decryptions_of_the_same_sum_differ_by_more_than_the_ckks_error():
    """Flooding (Li-Micciancio): the key holder's noise, from OS entropy, masks the
    decryption error; the same ciphertext sum decrypted twice gives different releases."""
    from privfedcal.privacy.secagg import flooding_std

    h = KeyHolder(CKKSParams.for_magnitude(1e3, 1e-10, max_clients=8))
    agg = ServerAggregator(h.public_context_bytes(), LAYOUT)
    for s in (1, 2, 3):
        agg.add(encrypt_payload(client_payload(s), LAYOUT, h.public_context_bytes()))
    a = h.decrypt_aggregate(agg.result(), LAYOUT, n_clients=3)
    b = h.decrypt_aggregate(agg.result(), LAYOUT, n_clients=3)
    raw = h.decrypt_aggregate(agg.result(), LAYOUT, n_clients=3, flood_bits=None)
    err = h.params.error_bound(3)
    diff = max((a[k] - b[k]).abs().max().item() for k in LAYOUT.names)
    assert diff > 10 * err
    # the flooding has the stated scale: std of (a - raw) near sigma_f
    std = flooding_std(h.params, 3, LAYOUT.size)
    dev = torch.cat([(a[k] - raw[k]).flatten() for k in LAYOUT.names])
    assert dev.abs().max().item() < 8 * std
    assert diff > err


def test_flooding_has_the_40_bit_scale():
    """The flooding std, measured over repeated decryptions of one sum, is the one 40-bit
    statistical security asks for (Li-Micciancio: 2^20 sqrt(entries) times the CKKS error
    bound E = n 4 N / 2^scale_bits, written out here independently of ``flooding_std``).
    Flooding reduced by 2^10 (FLOOD_BITS 20) or to 1 bit fails it."""
    import math

    p = CKKSParams.for_magnitude(1e3, 1e-10, max_clients=8)
    h = KeyHolder(p)
    agg = ServerAggregator(h.public_context_bytes(), LAYOUT)
    for s in (1, 2, 3):
        agg.add(encrypt_payload(client_payload(s), LAYOUT, h.public_context_bytes()))
    raw = h.decrypt_aggregate(agg.result(), LAYOUT, n_clients=3, flood_bits=None)
    devs = []
    for _ in range(8):
        a = h.decrypt_aggregate(agg.result(), LAYOUT, n_clients=3)
        devs.append(torch.cat([(a[k] - raw[k]).flatten() for k in LAYOUT.names]))
    dev = torch.cat(devs).double()
    error_bound = 3 * 4.0 * p.poly_modulus_degree / 2.0 ** p.scale_bits
    expected = 2.0 ** 20 * math.sqrt(LAYOUT.size) * error_bound
    measured = float(dev.std())
    assert 0.8 * expected < measured < 1.25 * expected, (measured, expected)
