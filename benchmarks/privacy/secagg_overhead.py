"""Secure aggregation against one training round (issue targets: < 25% of a CReFF round;
CCVR's one-shot encrypted statistics < one training round).

    python benchmarks/privacy/secagg_overhead.py [--threads 2]

A training round is measured as the CCVR CNN's training throughput (bare SGD loop, batch 64,
CIFAR-shaped random data) times the images one round processes in the papers' settings:
CCVR (CIFAR-10, 10 clients, E = 10: 500k images) and CReFF (CIFAR-10-LT IF 100, 20 clients,
8 per round, E = 10: about 50k images). Secure aggregation is timed through privfedcal's own
encrypt stage (encrypt, server add, key-holder decrypt) on uploads of the real shapes
(C = 10, d = 256). Clients encrypt in parallel in a federation, so a round's added wall time is
one client's encryption plus the server's additions plus the decryption.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.models import create_model
from privfedcal.privacy.secagg import ServerAggregator
from privfedcal.privacy.secagg_stage import CKKSSettings, EncryptStage, key_holder_release, unpad
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.uplink import Uplink

C, D = 10, 256


def train_throughput(threads: int, images: int = 3072, batch: int = 64) -> float:
    torch.set_num_threads(threads)
    model = create_model("cnn", num_classes=C, in_channels=3, image_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(images, 3, 32, 32), torch.randint(0, C, (images,))
    for warm in (True, False):
        t0 = time.perf_counter()
        for s in range(0, images, batch):
            loss = F.cross_entropy(model(x[s:s + batch]), y[s:s + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if not warm:
            return images / (time.perf_counter() - t0)
    raise AssertionError


def ccvr_payload(g, n=500):
    z = F.normalize(torch.randn(C, n // C, D, generator=g, dtype=torch.float64), dim=-1)
    return {"count": torch.full((C,), float(n // C), dtype=torch.float64), "sum": z.sum(1),
            "outer": torch.einsum("cnd,cne->cde", z, z)}


def creff_payload(g):
    return {"grad": torch.randn(C, C, D + 1, generator=g, dtype=torch.float64) * 0.01,
            "holders": torch.ones(C, dtype=torch.float64)}


def secure_release(payloads, label: str, n_total: int) -> tuple[float, float, int]:
    """(seconds for one client's encryption, seconds server add + decrypt, bytes/client)."""
    k = len(payloads)
    stage = CKKSSettings(bounds={"count": n_total, "holders": k, "sum": n_total,
                                "outer": n_total, "grad": n_total}, dp=None, clients=k,
                        hide_counts=True)
    up = Uplink([EncryptStage(stage)])  # the uplink's encrypt stage, opened as a run opens it
    rel = up.release(label, 1, list(range(k)), list(range(k)), payloads[0], Transcript(None))
    up.open(rel)
    sealing = rel.state["sealing"]
    sealing.context()  # clients load the public context once, before any upload
    server = ServerAggregator(sealing.public, sealing.layout, n_threads=1)
    enc, size = [], 0
    server_time = 0.0
    for p in payloads:
        t0 = time.perf_counter()
        data = sealing.seal(p)
        enc.append(time.perf_counter() - t0)
        size = len(data)
        t0 = time.perf_counter()
        server.add(unpad(data))
        server_time += time.perf_counter() - t0
    t0 = time.perf_counter()
    key_holder_release(rel.state["key-holder"], server.result(), sealing.layout, server.count,
                       stage.min_clients)
    server_time += time.perf_counter() - t0
    return max(enc), server_time, size


def main() -> None:
    ap = harness.parser(__doc__, threads=2)
    args = harness.parse(ap)
    ips = train_throughput(args.threads)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ccvr_round = 500_000 / ips
    creff_round = 8 * 620 * 10 / ips
    print(f"CNN training throughput: {ips:,.0f} images/s ({args.threads} threads)")
    print(f"one CCVR-setting round (500k images): {ccvr_round:.1f} s;  "
          f"one CReFF-setting round (~50k images): {creff_round:.1f} s")
    results = {"train_images_per_s": ips, "ccvr_round_s": ccvr_round,
               "creff_round_s": creff_round}
    enc, srv, size = secure_release([ccvr_payload(g) for _ in range(10)], "ccvr-stats", 50_000)
    plain = (C + C * D + C * D * D) * 4
    total = enc + srv
    results["ccvr"] = {"bytes_per_client": size, "encrypt_s_per_client": enc,
                       "server_add_decrypt_s": srv, "share_of_round": total / ccvr_round}
    print(f"CCVR statistics, 10 clients: {size / 2**20:.2f} MiB/client ({size / plain:.2f}x "
          f"float32 full), encrypt {enc:.2f} s/client, server add+decrypt {srv:.2f} s -> "
          f"{total:.2f} s = {100 * total / ccvr_round:.1f}% of a round (target < 100%)")
    enc, srv, size = secure_release([creff_payload(g) for _ in range(8)], "creff-grad", 12_406)
    plain = (C * C * (D + 1) + C) * 4
    total = enc + srv
    results["creff"] = {"bytes_per_client": size, "encrypt_s_per_client": enc,
                        "server_add_decrypt_s": srv, "share_of_round": total / creff_round}
    print(f"CReFF gradients, 8 clients: {size / 2**20:.2f} MiB/client ({size / plain:.2f}x "
          f"float32), encrypt {enc:.3f} s/client, server add+decrypt {srv:.3f} s -> "
          f"{total:.3f} s = {100 * total / creff_round:.2f}% of a round (target < 25%)")
    harness.finish(args, results)


if __name__ == "__main__":
    main()
