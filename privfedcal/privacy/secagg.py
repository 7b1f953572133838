"""CKKS secure aggregation of calibration uploads with TenSEAL (addition only).

Roles (docs/threat-model.md, docs/privacy/secure-aggregation.md): clients encrypt packed
payloads under the key holder's public context (``encrypt_payload``); the server
(``ServerAggregator``) holds that public context only and adds ciphertexts; the ``KeyHolder``,
who must not collude with the server, decrypts the aggregate, never an individual upload.

Parameters (``CKKSParams.for_magnitude``; derivation in docs/privacy/secure-aggregation.md,
"Parameters", measurements in docs/results/privacy.md).
Addition never rescales, so ciphertexts stay at the data level, whose modulus q is the
product of all primes but the last (SEAL's special prime). An aggregate entry x encodes to
coefficients up to |x| * 2^scale_bits; once that reaches q/2 the decryption wraps around to
garbage *without any error* ([60, 40] at 2^40: q ~ 2^60, sums past 2^19 ~ 5.2e5 wrap). Rule:
data_bits >= scale_bits + log2(max_abs_sum) + MARGIN_BITS. A fresh ciphertext's error is at
most 4N / 2^scale_bits (measured <= 1.7N), n uploads at most n times that; the scale makes it
<= ``precision``. The whole modulus respects SEAL's 128-bit table (4096 -> 109 bits,
8192 -> 218, 16384 -> 438, 32768 -> 881); the smallest fitting degree is chosen.

When the guarantee stops: if the key holder colludes with the server. Exact CKKS
decryptions handed to a party holding the ciphertexts leak the secret key (Li & Micciancio,
EUROCRYPT 2021). The key holder therefore floods every decryption (``flooding_std``): it adds
Gaussian noise, drawn from OS entropy, of std ``sigma_f = 2^(s/2) * sqrt(L * Q) * E`` where
E bounds the per-entry key-dependent error (CKKS encryption error of n uploads), L is the
number of released entries, Q the decryptions per key (1: keys are fresh per release) and
s = ``FLOOD_BITS`` = 40 the statistical security level. The noise is added to the aggregate
ciphertext (as a plaintext) BEFORE decryption, so SEAL's double-precision decoding is
post-processing of the flooded value. For any two error vectors the released distributions
are then within statistical distance ``sqrt(L) E / sigma_f = 2^(-s/2)`` (Gaussian shift
bound), the noise-flooding level Li, Micciancio, Schultz & Sorrell (CRYPTO 2022) show gives
s bits against key recovery (a search problem). Rounding to a grid coarser than the error (``round_to``) is applied on
top. Ciphertexts are malleable; a sender that breaks the declared bound or forges a key id is
caught only at decryption (``UploadRejected``: that release is not made).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from privfedcal.errors import UploadRejected, UsageError
from privfedcal.privacy.packing import EncryptedUpload, PayloadLayout
from privfedcal.privacy.reasons import Reason

if TYPE_CHECKING:
    import tenseal as ts


def _tenseal() -> Any:
    """TenSEAL, imported on first use: runs without secure aggregation never load it."""
    import tenseal

    return tenseal

__all__ = [
    "CKKSParams",
    "EncryptedUpload",
    "KeyHolder",
    "ServerAggregator",
    "encrypt_payload",
    "key_id_of",
    "load_public_context",
]

# SEAL's HomomorphicEncryption.org table: largest total coeff-modulus bits for 128-bit security.
MAX_MODULUS_BITS: dict[int, int] = {4096: 109, 8192: 218, 16384: 438, 32768: 881}
MARGIN_BITS = 4  # 1 bit: centred lift; 3 bits: error headroom + overflow detection
SPECIAL_PRIME_BITS = 24  # key switching only; measured not to change the fresh error
FRESH_ERROR_PER_DEGREE = 4.0  # bound on fresh error (scaled units) / N; measured max ~1.7
_MIN_PRIME_BITS, _MAX_PRIME_BITS = 20, 60
#: statistical security level s of decryption flooding (sigma_f = 2^(s/2) sqrt(L Q) E)
FLOOD_BITS = 40


def flooding_std(params: CKKSParams, n_clients: int, entries: int, *,
                 bits: int = FLOOD_BITS, decryptions: int = 1) -> float:
    """Std of the key holder's flooding noise for one release of ``entries`` values summed
    from ``n_clients`` uploads (module docstring): ``2^(bits/2) sqrt(entries decryptions) E``
    with E = ``error_bound(n_clients)``, the bound on the key-dependent CKKS error."""
    if entries < 1 or decryptions < 1 or bits < 1:
        raise ValueError("entries, decryptions and bits must be >= 1")
    return 2.0 ** (bits / 2) * math.sqrt(entries * decryptions) * params.error_bound(n_clients)


@dataclass(frozen=True)
class CKKSParams:
    """CKKS parameters for addition-only aggregation; ``for_magnitude`` derives them."""

    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int
    n_threads: int = 1  # TenSEAL's default (all cores) thread pool crashed elsewhere
    max_abs_sum: float | None = None  # declared bound on every aggregate entry (checked)
    max_clients: int = 1024  # most uploads one aggregate may sum

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "coeff_mod_bit_sizes", tuple(int(b) for b in self.coeff_mod_bit_sizes)
        )
        n, chain = self.poly_modulus_degree, self.coeff_mod_bit_sizes
        if n not in MAX_MODULUS_BITS:
            raise UsageError(
                f"CKKS poly_modulus_degree must be one of {sorted(MAX_MODULUS_BITS)}, got {n}"
            )
        if len(chain) < 2 or not all(_MIN_PRIME_BITS <= b <= _MAX_PRIME_BITS for b in chain):
            raise UsageError(
                f"CKKS coeff_mod_bit_sizes needs >= 2 primes of 20..60 bits, got {list(chain)}"
            )
        if sum(chain) > MAX_MODULUS_BITS[n]:
            raise UsageError(
                f"CKKS modulus of {sum(chain)} bits exceeds the 128-bit security bound "
                f"of {MAX_MODULUS_BITS[n]} bits for degree {n}"
            )
        if not 1 <= self.scale_bits < self.data_bits - 1:
            raise UsageError(
                f"CKKS scale_bits must be in [1, {self.data_bits - 2}], got {self.scale_bits}"
            )
        if self.n_threads < 1 or self.max_clients < 1:
            raise UsageError("CKKS n_threads and max_clients must be >= 1")
        if self.max_abs_sum is not None:
            m = self.max_abs_sum
            if not (math.isfinite(m) and m > 0):
                raise UsageError(f"CKKS max_abs_sum must be positive and finite, got {m}")
            if math.log2(m) > self.data_bits - self.scale_bits - MARGIN_BITS:
                raise UsageError(
                    f"CKKS chain {list(chain)} at scale 2^{self.scale_bits} cannot hold "
                    f"sums of magnitude {m:g}: use CKKSParams.for_magnitude"
                )

    @classmethod
    def for_magnitude(
        cls,
        max_abs_sum: float,
        precision: float = 1e-6,
        *,
        max_clients: int = 1024,
        n_threads: int = 1,
    ) -> CKKSParams:
        """Smallest secure parameters whose aggregate of up to ``max_clients`` uploads, each
        entry at most ``max_abs_sum`` in absolute value, decrypts within ``precision``
        (absolute error per entry)."""
        if not (math.isfinite(max_abs_sum) and max_abs_sum > 0):
            raise UsageError(f"max_abs_sum must be positive and finite, got {max_abs_sum}")
        if not (math.isfinite(precision) and precision > 0):
            raise UsageError(f"precision must be positive and finite, got {precision}")
        if max_clients < 1:
            raise UsageError("max_clients must be >= 1")
        value_bits = max(0, math.ceil(math.log2(max_abs_sum)))
        for n in sorted(MAX_MODULUS_BITS):
            scale_bits = max(
                1, math.ceil(math.log2(max_clients * FRESH_ERROR_PER_DEGREE * n / precision))
            )
            data_bits = max(_MIN_PRIME_BITS + 4, scale_bits + value_bits + MARGIN_BITS)
            k = math.ceil(data_bits / _MAX_PRIME_BITS)
            primes = [data_bits // k + (1 if i < data_bits % k else 0) for i in range(k)]
            if data_bits + SPECIAL_PRIME_BITS <= MAX_MODULUS_BITS[n]:
                return cls(
                    n,
                    (*primes, SPECIAL_PRIME_BITS),
                    scale_bits,
                    n_threads,
                    float(max_abs_sum),
                    max_clients,
                )
        raise UsageError(
            f"no secure CKKS parameters hold sums of {max_abs_sum:g} to precision "
            f"{precision:g}: relax the precision or the bound"
        )

    @property
    def data_bits(self) -> int:
        """Bits of the data-level modulus (all primes but the special one)."""
        return sum(self.coeff_mod_bit_sizes[:-1])

    @property
    def slots(self) -> int:
        return self.poly_modulus_degree // 2

    def error_bound(self, n_clients: int) -> float:
        """Bound on the absolute CKKS error of an aggregate of ``n_clients`` uploads."""
        return n_clients * FRESH_ERROR_PER_DEGREE * self.poly_modulus_degree / 2.0**self.scale_bits

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["coeff_mod_bit_sizes"] = list(self.coeff_mod_bit_sizes)
        return d


def key_id_of(public_context_bytes: bytes) -> str:
    """Identifier of a key: SHA-256 of its serialised public context (first 32 hex digits)."""
    return hashlib.sha256(public_context_bytes).hexdigest()[:32]


def _serialise_public(ctx: ts.Context) -> bytes:
    # No relinearisation / Galois keys: addition needs neither, and they are large.
    return ctx.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )


def _slots(ctx: ts.Context) -> int:
    return ctx.seal_context().data.key_context_data().parms().poly_modulus_degree() // 2


def _chunk_lengths(size: int, slots: int) -> list[int]:
    return [min(slots, size - i) for i in range(0, size, slots)]


def _load_vector(ctx: ts.Context, data: bytes, expected_len: int, what: str) -> ts.CKKSVector:
    try:
        vec = _tenseal().ckks_vector_from(ctx, data)
    except Exception as exc:  # TenSEAL/SEAL raise ValueError, RuntimeError or TypeError
        raise UploadRejected(f"{what} does not deserialise under this key ({exc})",
                             reason=Reason.INVALID_CIPHERTEXT) from exc
    if vec.size() != expected_len:
        raise UploadRejected(f"{what} holds {vec.size()} values, expected {expected_len}",
                             reason=Reason.INVALID_CIPHERTEXT)
    # A fresh ciphertext: one SEAL ciphertext of size 2 at the first data level and the
    # global scale. Anything else (rescaled, mod-switched, unrelinearised) would be
    # auto-aligned by TenSEAL on addition, shrinking the modulus of the whole aggregate.
    cts = vec.ciphertext()
    first = ctx.seal_context().data.first_parms_id()
    if (
        len(cts) != 1
        or cts[0].size() != 2
        or cts[0].parms_id() != first
        or cts[0].scale != ctx.global_scale
        or cts[0].is_transparent()
    ):
        raise UploadRejected(f"{what} is not a fresh ciphertext at this key's level and scale",
                             reason=Reason.INVALID_CIPHERTEXT)
    return vec


def load_public_context(public_context_bytes: bytes, *, n_threads: int = 1) -> ts.Context:
    """Load a context for encrypting or adding; refuses one that carries a secret key."""
    try:
        ctx = _tenseal().context_from(public_context_bytes, n_threads=n_threads)
    except Exception as exc:
        raise UsageError(f"public CKKS context does not deserialise ({exc})") from exc
    if ctx.is_private():
        raise UsageError(
            "this CKKS context holds the secret key: clients and server must get "
            "KeyHolder.public_context_bytes()"
        )
    return ctx


def encrypt_payload(
    payload: Mapping[str, Tensor],
    layout: PayloadLayout,
    public: bytes | ts.Context,
    *,
    n_threads: int = 1,
) -> EncryptedUpload:
    """Client side: pack ``payload`` and encrypt it in as few ciphertexts as the slots allow."""
    if isinstance(public, _tenseal().Context):
        ctx, key_id = public, key_id_of(_serialise_public(public))
    else:
        ctx, key_id = load_public_context(public, n_threads=n_threads), key_id_of(public)
    vector = layout.pack(payload)
    slots = _slots(ctx)
    chunks = []
    for start in range(0, vector.size, slots):
        try:
            vec = _tenseal().ckks_vector(ctx, vector[start : start + slots].tolist())
        except ValueError as exc:  # SEAL: "encoded values are too large"
            raise UploadRejected(f"payload does not fit the CKKS parameters ({exc})",
                                 reason=Reason.CKKS_OVERFLOW) from exc
        chunks.append(vec.serialize())
    return EncryptedUpload(key_id, layout.digest(), tuple(chunks))


class KeyHolder:
    """Holds the CKKS secret key; decrypts aggregates only, rounded, under rotating keys.

    Keys come from SEAL's CSPRNG (TenSEAL offers no seed, and seeded keys would be
    predictable): exact resume goes through ``state_dict`` / ``load_state_dict``.
    """

    _FORMAT = "privfedcal.ckks-keyholder/1"

    def __init__(self, params: CKKSParams) -> None:
        self.params = params
        self.rotations = 0
        self._new_keys()

    def _new_keys(self) -> None:
        p = self.params
        try:
            ctx = _tenseal().context(
                _tenseal().SCHEME_TYPE.CKKS,
                poly_modulus_degree=p.poly_modulus_degree,
                coeff_mod_bit_sizes=list(p.coeff_mod_bit_sizes),
                n_threads=p.n_threads,
            )
        except (ValueError, RuntimeError) as exc:  # e.g. "failed to find enough qualifying primes"
            raise UsageError(f"SEAL rejected CKKS parameters {p.to_dict()}: {exc}") from exc
        ctx.global_scale = 2.0**p.scale_bits
        self._ctx = ctx
        self._public = _serialise_public(ctx)
        self.key_id = key_id_of(self._public)

    def public_context_bytes(self) -> bytes:
        """The context clients and the server get: public key only, no secret key."""
        return self._public

    def rotate(self) -> str:
        """Draw fresh keys (do this per calibration); returns the new ``key_id``."""
        self._new_keys()
        self.rotations += 1
        return self.key_id

    def decrypt_aggregate(
        self,
        ciphertexts: Sequence[bytes],
        layout: PayloadLayout,
        *,
        n_clients: int | None = None,
        round_to: float | None = None,
        noise: float = 0.0,
        generator: torch.Generator | None = None,
        flood_bits: int | None = FLOOD_BITS,
    ) -> dict[str, Tensor]:
        """Decrypt the server's sum of ``n_clients`` uploads (default ``max_clients``).

        ``flood_bits``: statistical security of the flooding noise (``flooding_std``, drawn
        from OS entropy; ``None`` releases without flooding, for tests of the raw error only);
        ``noise``: std of extra Gaussian noise added before release (needs ``generator``);
        ``round_to``: release grid, at least twice the CKKS error bound of ``n_clients``.
        Raises ``UploadRejected`` if an entry exceeds ``max_abs_sum``: an upload broke the
        declared bound or was encrypted under another key, and the round must be discarded.
        """
        n, err = self._release_checks(n_clients, round_to, noise, generator)
        lengths = _chunk_lengths(layout.size, self.params.slots)
        if len(ciphertexts) != len(lengths):
            raise UploadRejected(
                f"aggregate has {len(ciphertexts)} chunks, layout needs {len(lengths)}",
                reason=Reason.INVALID_CIPHERTEXT)
        std = flooding_std(self.params, n, layout.size, bits=flood_bits) \
            if flood_bits is not None and layout.size else 0.0
        vector = self._decrypt_flooded(ciphertexts, lengths, std)
        self._check_bound(vector, err, std)
        if noise > 0:
            vector = (
                vector
                + noise * torch.randn(vector.size, generator=generator, dtype=torch.float64).numpy()
            )
        if round_to is not None:
            vector = np.round(vector / round_to) * round_to
        return layout.unpack(vector)

    def _release_checks(self, n_clients: int | None, round_to: float | None, noise: float,
                        generator: torch.Generator | None) -> tuple[int, float]:
        """``decrypt_aggregate``'s arguments checked: the number of uploads summed and the
        CKKS error bound of that many."""
        p = self.params
        n = p.max_clients if n_clients is None else n_clients
        if not 1 <= n <= p.max_clients:
            raise UsageError(
                f"n_clients must be in [1, {p.max_clients}] for these parameters, got {n}"
            )
        err = p.error_bound(n)
        if round_to is not None and not (math.isfinite(round_to) and round_to >= 2 * err):
            raise UsageError(
                f"round_to={round_to} must be >= {2 * err:.3g}, twice the CKKS error "
                f"bound of {n} uploads (else the release exposes the error)"
            )
        if noise < 0 or not math.isfinite(noise) or (noise > 0 and generator is None):
            raise UsageError("noise must be finite, >= 0, and come with a torch.Generator")
        return n, err

    def _decrypt_flooded(self, ciphertexts: Sequence[bytes], lengths: Sequence[int],
                         std: float) -> np.ndarray:
        """The aggregate's chunks decrypted into one vector, each flooded first with
        Gaussian noise of ``std`` inside the ciphertext (OS entropy; none at 0)."""
        if std > 0:
            from privfedcal.privacy.noise import noise_generator

            g = noise_generator()  # OS entropy, whatever the run's noise setting
        parts = []
        for i, (c, k) in enumerate(zip(ciphertexts, lengths, strict=True)):
            vec = _load_vector(self._ctx, c, k, f"aggregate chunk {i}")
            if std > 0:  # flood inside the ciphertext: decoding is then post-processing
                vec = vec + (std * torch.randn(k, generator=g, dtype=torch.float64)).tolist()
            parts.append(np.asarray(vec.decrypt()))
        return np.concatenate(parts) if parts else np.zeros(0)

    def _check_bound(self, vector: np.ndarray, err: float, std: float) -> None:
        """Raise ``UploadRejected`` for an entry past ``max_abs_sum`` (with the CKKS error
        ``err`` and the flooding of ``std`` allowed for)."""
        p = self.params
        if p.max_abs_sum is None or not vector.size:
            return
        worst = float(np.max(np.abs(vector)))
        # Slack: float32 client sums may pass an exact bound by a few ulps.
        if worst > p.max_abs_sum * (1 + 1e-5) + err + 10 * std:
            raise UploadRejected(
                f"aggregate entry {worst:.4g} exceeds the declared bound "
                f"{p.max_abs_sum:g}: an upload broke the bound or used a foreign key",
                reason=Reason.BOUND_EXCEEDED)

    def state_dict(self) -> dict[str, Any]:
        """Resume state: parameters and TenSEAL's serialisation of the secret context (no pickle)."""
        secret = self._ctx.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        return {
            "format": self._FORMAT,
            "params": self.params.to_dict(),
            "rotations": self.rotations,
            "secret_context": secret,
            "public_context": self._public,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != self._FORMAT:
            raise UsageError(f"not a KeyHolder state (format {state.get('format')!r})")
        params = CKKSParams(**state["params"])
        ctx = _tenseal().context_from(bytes(state["secret_context"]), n_threads=params.n_threads)
        if not ctx.is_private():
            raise UsageError("KeyHolder state holds no secret key")
        public = bytes(state["public_context"])
        if _serialise_public(ctx) != public:
            raise UsageError("KeyHolder state: public context does not match the secret context")
        self.params, self._ctx, self._public = params, ctx, public
        self.key_id, self.rotations = key_id_of(public), int(state["rotations"])

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> KeyHolder:
        holder = cls.__new__(cls)
        holder.load_state_dict(state)
        return holder


class ServerAggregator:
    """Server side: adds encrypted uploads under a public context; cannot decrypt."""

    def __init__(
        self, public_context_bytes: bytes, layout: PayloadLayout, *, n_threads: int = 1
    ) -> None:
        self._ctx = load_public_context(public_context_bytes, n_threads=n_threads)
        self.key_id = key_id_of(public_context_bytes)
        self.layout = layout
        self._layout_hash = layout.digest()
        self._lengths = _chunk_lengths(layout.size, _slots(self._ctx))
        self._acc: list[ts.CKKSVector] | None = None
        self.count = 0

    @property
    def context(self) -> ts.Context:
        return self._ctx

    def add(self, upload: EncryptedUpload | bytes) -> None:
        """Validate one upload fully, then add it; a rejected upload leaves the sum unchanged."""
        self.accumulate(self.prepare(upload))

    def prepare(self, upload: EncryptedUpload | bytes) -> list[ts.CKKSVector]:
        """One upload validated and loaded (key id, layout, chunk count, ciphertexts), not
        yet added: the caller decides which uploads enter the sum (whole cohorts)."""
        if not isinstance(upload, EncryptedUpload):
            upload = EncryptedUpload.from_bytes(upload)
        if upload.key_id != self.key_id:
            raise UploadRejected(
                f"upload made under key {upload.key_id[:8]}.., server holds {self.key_id[:8]}..",
                reason=Reason.INVALID_CIPHERTEXT)
        if upload.layout_hash != self._layout_hash:
            raise UploadRejected("upload was packed with another payload layout",
                                 reason=Reason.INVALID_CIPHERTEXT)
        if len(upload.chunks) != len(self._lengths):
            raise UploadRejected(
                f"upload has {len(upload.chunks)} chunks, layout needs {len(self._lengths)}",
                reason=Reason.INVALID_CIPHERTEXT)
        return [
            _load_vector(self._ctx, c, k, f"upload chunk {i}")
            for i, (c, k) in enumerate(zip(upload.chunks, self._lengths, strict=True))
        ]

    def accumulate(self, vecs: list[ts.CKKSVector]) -> None:
        """Add a prepared upload to the sum."""
        if self._acc is None:
            self._acc = vecs
        else:
            try:
                self._acc = [a + v for a, v in zip(self._acc, vecs, strict=True)]
            except (ValueError, RuntimeError) as exc:  # SEAL: parameter or scale mismatch
                raise UploadRejected(f"upload ciphertexts cannot be added ({exc})",
                                     reason=Reason.INVALID_CIPHERTEXT) from exc
        self.count += 1

    def result(self) -> list[bytes]:
        """The encrypted sum, one serialised chunk per ciphertext, for the key holder."""
        if self._acc is None:
            raise UsageError("ServerAggregator.result() before any upload was added")
        return [v.serialize() for v in self._acc]
