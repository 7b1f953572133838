"""Cost of CKKS secure aggregation for calibration uploads, against plaintext float32.

Workloads (C = 10 classes, d = 256 features): CCVR statistics ``count (C,)``, ``sum (C, d)``,
``outer (C, d, d)`` packed either as the full covariance or as its upper triangle, and CReFF
class gradients ``grad (C, C, d + 1)`` with ``count (C,)``. Parameters come from
``CKKSParams.for_magnitude`` for the largest sum the aggregate can take:
``samples * max(1, clip, clip^2)`` (counts, sums of clipped rows, their outer products).

    python benchmarks/privacy/secagg.py [--clients 4] [--samples 50000] [--clip 1] [--precision 1e-6]

Prints the CKKS parameters, then per workload: ciphertext bytes per client and their ratio
to the plaintext float32 payload; wall and CPU seconds to encrypt all clients' uploads, to
add them on the server and to decrypt the aggregate; and the worst decryption error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.privacy.packing import PayloadLayout
from privfedcal.privacy.secagg import CKKSParams, KeyHolder, ServerAggregator, encrypt_payload

C, D = 10, 256


def ccvr(g: torch.Generator) -> dict[str, torch.Tensor]:
    z = torch.nn.functional.normalize(torch.randn(C, 20, D, generator=g), dim=-1)
    return {
        "count": torch.full((C,), 20.0),
        "sum": z.sum(1),
        "outer": torch.einsum("cnd,cne->cde", z, z),
    }


def creff(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"grad": torch.randn(C, C, D + 1, generator=g) * 0.01, "count": torch.full((C,), 20.0)}


class Clock:
    """Wall and CPU seconds of a block (CPU time is robust to other processes' load)."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def __str__(self) -> str:
        return f"{self.wall:6.2f}s (cpu {self.cpu:5.2f}s)"


def run(name: str, payloads, symmetric: set[str], params: CKKSParams) -> dict:
    layout = PayloadLayout.from_payload(payloads[0], symmetric=symmetric)
    holder = KeyHolder(params)
    public = holder.public_context_bytes()
    plain_bytes = sum(t.numel() * 4 for t in payloads[0].values())
    with Clock() as enc:
        uploads = [encrypt_payload(p, layout, public).to_bytes() for p in payloads]
    with Clock() as add:
        agg = ServerAggregator(public, layout)
        for u in uploads:
            agg.add(u)
        result = agg.result()
    with Clock() as dec:
        out = holder.decrypt_aggregate(result, layout, n_clients=len(payloads))
    plain = {k: sum(p[k].double() for p in payloads) for k in payloads[0]}
    err = max((out[k] - plain[k]).abs().max().item() for k in plain)
    per_client = len(uploads[0])
    print(
        f"{name}: {layout.size} values in {len(result)} ciphertexts\n"
        f"  bytes/client {per_client / 2**20:.2f} MiB = x{per_client / plain_bytes:.2f} the "
        f"plaintext float32 payload ({plain_bytes / 2**20:.2f} MiB)\n"
        f"  encrypt (all {len(payloads)} clients) {enc}  server add {add}  decrypt {dec}  "
        f"max error {err:.1e}"
    )
    return {"values": layout.size, "ciphertexts": len(result), "bytes_per_client": per_client,
            "plaintext_float32_bytes": plain_bytes,
            **{f"{k}_{unit}": getattr(c, unit) for k, c in
               (("encrypt_all", enc), ("server_add", add), ("decrypt", dec))
               for unit in ("wall", "cpu")}, "max_error": err}


def main() -> None:
    ap = harness.parser(__doc__, threads=1)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--samples", type=int, default=50_000, help="total samples, all clients")
    ap.add_argument("--clip", type=float, default=1.0, help="feature / gradient clip bound R")
    ap.add_argument("--precision", type=float, default=1e-6)
    args = harness.parse(ap)
    torch.set_num_threads(args.threads)
    max_abs = args.samples * max(1.0, args.clip, args.clip**2)
    params = CKKSParams.for_magnitude(
        max_abs, args.precision, max_clients=max(args.clients, 1), n_threads=args.threads
    )
    print(
        f"clients {args.clients}, max |sum| {max_abs:g}, precision {args.precision:g}: "
        f"N={params.poly_modulus_degree} chain={list(params.coeff_mod_bit_sizes)} "
        f"scale=2^{params.scale_bits} ({params.slots} slots/ciphertext)"
    )
    g = torch.Generator().manual_seed(0)
    stats = [ccvr(g) for _ in range(args.clients)]
    grads = [creff(g) for _ in range(args.clients)]
    results = {"ckks": {"poly_modulus_degree": params.poly_modulus_degree,
                        "coeff_mod_bit_sizes": list(params.coeff_mod_bit_sizes),
                        "scale_bits": params.scale_bits, "slots": params.slots}}
    results["CCVR full covariance"] = run("CCVR full covariance", stats, set(), params)
    results["CCVR upper triangle"] = run("CCVR upper triangle", stats, {"outer"}, params)
    results["CReFF gradients"] = run("CReFF gradients", grads, set(), params)
    harness.finish(args, results)


if __name__ == "__main__":
    main()
