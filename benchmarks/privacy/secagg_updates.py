"""Secure aggregation of model updates (--secagg-updates) against a training round.

    PYTHONPATH=$PWD python benchmarks/privacy/secagg_updates.py [--rounds 3] [--clients 10]

Runs the same digits FedAvg experiment twice through privfedcal's simulator (one thread):
once with plaintext FedAvg and once with CKKS sums of the n_k-weighted updates
(the uplink's encrypt wire, privfedcal/privacy/planner.py ``updates_plan``: every client
encrypts, the server adds, the key holder decrypts the flooded sum). Reports the mean training-round time of the plain run, the mean secure
aggregation time per round (all clients' encryption sequentially + additions + decryption;
in a federation clients encrypt in parallel, so the added wall time is lower), and the
ciphertext bytes per client against the float32 update.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.experiment import build_simulator
from privfedcal.settings.run_config import RunConfig


def run(out: Path, **kw) -> tuple[dict, object]:
    cfg = RunConfig.of(dataset="digits", device="cpu", threads=1, transcript=True, data_seed=0,
                    **kw)  # one partition for both runs (a protected run draws its own otherwise)
    sim = build_simulator(cfg, out)
    return sim.run(), sim


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    a = harness.parse(ap)
    with tempfile.TemporaryDirectory() as tmp:
        plain, _ = run(Path(tmp) / "plain", rounds=a.rounds, clients=a.clients)
        sec, sim = run(Path(tmp) / "sec", rounds=a.rounds, clients=a.clients,
                       secagg_updates=True)
        index = json.loads((Path(tmp) / "sec" / "server" / "transcript" / "index.json").read_text())
    round_s = plain["wall_seconds"] / a.rounds
    agg_s = sec["privacy"]["secagg_updates"]["mean_seconds_per_round"]
    ct = [e["bytes"] for e in index if e["label"] == "model-update" and e["view"] == "ciphertext"]
    per_client_plain = sec["model_update_bytes"] / (a.rounds * a.clients)
    results = {
        "clients": a.clients, "rounds": a.rounds,
        "plain_round_seconds": round(round_s, 3),
        "secure_aggregation_seconds_per_round": agg_s,
        "ratio_to_round": round(agg_s / round_s, 3),
        "ciphertext_bytes_per_client": int(sum(ct) / len(ct)),
        "float32_update_bytes_per_client": int(per_client_plain),
        "accuracy_plain": plain["accuracy"], "accuracy_secure": sec["accuracy"],
        "ckks": sec["privacy"]["secagg_updates"]["params"]}
    print(json.dumps(results, indent=1))
    harness.finish(a, results)


if __name__ == "__main__":
    main()
