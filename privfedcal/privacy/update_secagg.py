"""Secure aggregation of model updates (``--secagg-updates``): the server sees the sum only.

Each participant packs ``w_k * state_k`` for every floating-point tensor of its state plus
its weight ``w_k`` in one extra slot (``"__weight"``), encrypts it under a fresh CKKS key of
the key holder, and the server adds the ciphertexts under the public context. The key
holder decrypts the SUM (flooded, privacy/secagg.py), and the server divides by the summed
weight: the weighted average FedAvg needs, with neither any client's update nor its weight
(size n_k) ever in the clear. Integer buffers (BatchNorm counters) carry no data and are
taken from the global state the server sent.

Magnitude bound: every parameter is assumed within ``PARAM_BOUND`` in absolute value (a
data-independent bound; the shipped models' parameters stay far inside it); an update past
it makes the decrypted sum fail the key holder's check, and that round's aggregation falls
back to the previous global state (listed in ``skipped_releases``).
"""

from __future__ import annotations

import time

import torch

from privfedcal.errors import UploadRejected
from privfedcal.privacy.packing import PayloadLayout
from privfedcal.privacy.releases import UPDATE_RELEASE
from privfedcal.privacy.secagg import CKKSParams, KeyHolder, ServerAggregator, encrypt_payload
from privfedcal.privacy.secagg_stage import PRECISION
from privfedcal.privacy.transcript import Transcript

PARAM_BOUND = 100.0  # |parameter| assumed <= this; sums are bounded by it times sum(w_k)
WEIGHT_KEY = "__weight"


class SecureUpdates:
    """One object per run; ``average`` is called once per round."""

    def __init__(self, max_weight_sum: float, clients: int, min_clients: int = 2) -> None:
        self.max_weight_sum = float(max_weight_sum)
        self.clients = clients
        self.min_clients = min_clients  # the key holder decrypts no sum of fewer updates
        self.seconds: list[float] = []  # wall time of each round's secure aggregation
        self.params: dict | None = None

    def average(self, sent: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]],
                weights: list[float], clients: list[int], *, round_: int,
                transcript: Transcript) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        keys = [k for k, v in sent.items() if v.is_floating_point()]
        example = {WEIGHT_KEY: torch.zeros(1, dtype=torch.float64),
                   **{k: sent[k].detach().double().cpu() for k in keys}}
        layout = PayloadLayout.from_payload(example, symmetric=frozenset())
        params = CKKSParams.for_magnitude(PARAM_BOUND * self.max_weight_sum + self.max_weight_sum,
                                          PRECISION, max_clients=self.clients)
        self.params = params.to_dict()
        holder = KeyHolder(params)  # fresh keys every round, one decryption each
        public = holder.public_context_bytes()
        server = ServerAggregator(public, layout)
        for c, st, w in zip(clients, states, weights, strict=True):
            payload = {WEIGHT_KEY: torch.tensor([float(w)], dtype=torch.float64),
                       **{k: st[k].detach().double().cpu() * float(w) for k in keys}}
            data = encrypt_payload(payload, layout, public).to_bytes()  # on the client
            server.add(data)
            transcript.record(round_=round_, label=UPDATE_RELEASE, view="ciphertext", client=int(c),
                              bytes=len(data))
        if server.count < self.min_clients:  # the key holder's check, from its own setting
            raise UploadRejected(f"a sum of {server.count} update(s) is below the key holder's "
                                 f"minimum of {self.min_clients}: not decrypted")
        total = holder.decrypt_aggregate(server.result(), layout, n_clients=server.count)
        weight = float(total.pop(WEIGHT_KEY)[0])
        if not weight > 0:
            raise UploadRejected(f"decrypted weight sum {weight:g} is not positive")
        out = {k: v.clone() for k, v in sent.items()}
        for k in keys:
            out[k] = (total[k] / weight).to(sent[k].dtype).to(sent[k].device)
        # what the server obtained: the averaged state, and the summed weight
        transcript.record(round_=round_, label=UPDATE_RELEASE, view="aggregate", client=None,
                          tensors=out, clients=server.count, weight_sum=weight)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def summary(self) -> dict:
        n = len(self.seconds)
        return {"model_updates": "CKKS sums of weighted updates; the server sees the "
                                 "aggregate and the summed weight only",
                "params": self.params, "rounds": n,
                "mean_seconds_per_round": round(sum(self.seconds) / n, 4) if n else None}
