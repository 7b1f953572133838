"""The encrypt stage of the uplink: one CKKS session per release, fresh keys each time.

Roles: clients encrypt under the key holder's public context; the server's aggregator loads
that public context only (TenSEAL's ``is_private()`` is false there) and adds ciphertexts; the
key holder decrypts the sum alone, checks it against the declared magnitude bound, and
releases it rounded to a grid coarser than the CKKS error (Li & Micciancio 2020: exact
decryptions handed to a party that holds the ciphertexts enable key recovery). Keys are new
for every release (rotation per calibration step). The magnitude bound, from which the CKKS
modulus chain and scale are chosen, follows from the clip bounds, the number of samples and
clients, and the DP noise (10 standard deviations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from privfedcal.errors import UploadRejected
from privfedcal.privacy.packing import PayloadLayout
from privfedcal.privacy.secagg import (
    CKKSParams,
    KeyHolder,
    ServerAggregator,
    encrypt_payload,
    load_public_context,
)

PAD_SLACK = 1.25  # zstd output of SEAL ciphertexts stays within ~1.12x their entropy
NOISE_SIGMAS = 10.0  # P(|N(0,1)| > 10) ~ 1e-23: noise never breaks the declared bound
PRECISION = 1e-10  # absolute CKKS error per aggregate entry: small, so decryption flooding is small


def padded_size(params: CKKSParams, layout: PayloadLayout) -> int:
    """A fixed wire size for every upload of a release (hidden counts): TenSEAL compresses
    ciphertexts, so their byte size varies slightly with the encryption randomness; padding
    to a bound computed from the parameters alone makes every upload the same size."""
    chunks = -(-layout.size // params.slots)
    entropy = 2 * params.poly_modulus_degree * sum(params.coeff_mod_bit_sizes[:-1]) / 8
    return int(chunks * (PAD_SLACK * entropy + 4096) + 4096)


def pad(data: bytes, size: int | None) -> bytes:
    if size is None:
        return data
    if len(data) + 8 > size:
        raise UploadRejected(f"upload of {len(data)} bytes exceeds the padded size {size}")
    return len(data).to_bytes(8, "big") + data + bytes(size - 8 - len(data))


def unpad(data: bytes) -> bytes:
    """Server side: drop the padding (a length prefix says where the upload ends)."""
    if len(data) < 8:
        raise UploadRejected("upload shorter than its length prefix")
    n = int.from_bytes(data[:8], "big")
    if n > len(data) - 8:
        raise UploadRejected("upload truncated: length prefix exceeds the data")
    return data[8 : 8 + n]


@dataclass
class SecAggSession:
    """One release: the key holder's keys, the server's aggregator, the clients' context."""

    keyholder: KeyHolder
    server: ServerAggregator
    layout: PayloadLayout
    client_context: Any
    pad_to: int | None = None
    sizes: list[int] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.server.count

    def submit(self, payload: dict[str, Tensor]) -> int:
        """A client encrypts; the server checks and adds. Returns the bytes on the wire."""
        data = pad(encrypt_payload(payload, self.layout, self.client_context).to_bytes(),
                   self.pad_to)
        self.server.add(unpad(data) if self.pad_to is not None else data)
        self.sizes.append(len(data))
        return len(data)

    def release(self) -> dict[str, Tensor]:
        n = self.server.count
        grid = 2 * self.keyholder.params.error_bound(n)
        return self.keyholder.decrypt_aggregate(self.server.result(), self.layout,
                                                n_clients=n, round_to=grid)


@dataclass
class SecAggStage:
    bounds: dict[str, float]  # largest |aggregate entry| per payload key, before noise
    dp: Any
    clients: int
    hide_counts: bool = True
    params_used: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def for_run(cls, cfg, exp, *, clip: float, grad_clip: float, dp) -> SecAggStage:
        """Bounds from the calibrator's release declarations (privacy/releases.py)."""
        from privfedcal.privacy.releases import declared_releases

        n = float(sum(int(p.numel()) for p in exp.parts))
        k = float(cfg.clients)
        bounds = {"count": n, "holders": k, "sum": clip * n, "outer": clip * clip * n,
                  "grad": grad_clip * n}
        for r in declared_releases(cfg.calibrator):
            for key, b in r.bounds(clip=clip, grad_clip=grad_clip, examples=n,
                                   clients=k).items():
                bounds[key] = max(bounds.get(key, 0.0), b)
        return cls(bounds=bounds, dp=dp, clients=cfg.clients, hide_counts=cfg.hide_counts)

    def max_abs(self, label: str, keys) -> float:
        keys = list(keys)
        stds = self.dp.stds(keys, label) if self.dp is not None else {}
        return max(self.bounds[k] + NOISE_SIGMAS * stds.get(k, 0.0) for k in keys)

    def open(self, label: str, example: dict[str, Tensor]) -> SecAggSession:
        symmetric = {"outer"} & set(example)
        layout = PayloadLayout.from_payload(example, symmetric=frozenset(symmetric))
        params = CKKSParams.for_magnitude(self.max_abs(label, example), PRECISION,
                                          max_clients=self.clients)
        keyholder = KeyHolder(params)  # fresh keys for every release
        public = keyholder.public_context_bytes()
        server = ServerAggregator(public, layout, n_threads=1)
        client_ctx = load_public_context(public, n_threads=1)
        self.params_used[label] = params.to_dict()
        size = padded_size(params, layout) if self.hide_counts else None
        return SecAggSession(keyholder, server, layout, client_ctx, pad_to=size)

    def summary(self) -> dict[str, Any]:
        return {"scheme": "CKKS (TenSEAL)", "params": self.params_used,
                "min_clients": 2, "keys": "fresh per release; server holds the public context only",
                "release_rounding": "2 x CKKS error bound"}
