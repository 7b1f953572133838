"""A Flower node lost in training: what least squares over the server's secure sums learns.

    PYTHONPATH=$PWD python benchmarks/privacy/lost_node.py --clients 6 --participation 1.0 \
        --victim 4 [--dp-eps 8]

Runs CReFF (`--secagg --hide-counts`, sample weighting) over privfedcal's in-process Flower
grid (the real ServerApp and ClientApp), with client 0 as the key holder; the victim's node
fails on its `train` message in the first round after round 1 that selects it. Then, from
the server's transcript alone, it solves the run's released count sums (each row: the clients
whose ciphertexts entered it) together with the public class totals and the key holder's own
counts by least squares, and prints whether the victim's class counts are determined, the
estimate's largest error against the truth, and the run's own whole-run record.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from flwr.app import Context, RecordDict

from privfedcal.experiment import build_experiment
from privfedcal.flower import client_app as module
from privfedcal.flower.grid import InProcessGrid
from privfedcal.flower.records import FlowerOptions, to_run_config
from privfedcal.flower.server_app import run_server
from privfedcal.privacy.cohorts import select_clients
from privfedcal.privacy.transcript import load_transcript
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.settings.run_config import RunConfig


def settings(args: argparse.Namespace) -> RunConfig:
    extra = {} if args.dp_eps is None else {"dp_eps": args.dp_eps}
    return RunConfig.of(dataset="digits", clients=args.clients, participation=args.participation,
                     rounds=3 if args.participation >= 1 else 4, method="creff", secagg=True,
                     hide_counts=True, transcript=True, alpha=0.5, local_epochs=1,
                     batch_size=32, device="cpu", threads=1, seed=0, data_seed=0,
                     calibration_params={"match_steps": 5, "retrain_steps": 5,
                                         "weighting": "sample"}, **extra)


def run_with_lost_node(cfg: RunConfig, victim: int) -> tuple[object, dict, int]:
    """The run over the in-process grid with the victim's train reply an error."""
    keyed = cfg.replace(secagg_key_holder=0)
    lost = next(r for r in range(2, cfg.training.rounds + 1) if victim in select_clients(PrivacyOptions.of(keyed), r))
    real = module.train_client

    def train_client(*args):
        if tuple(args[-2:]) == (lost, victim):
            raise RuntimeError("the node is lost")
        return real(*args)

    module.train_client = train_client
    out = Path(tempfile.mkdtemp()) / "run"
    asked = len(select_clients(PrivacyOptions.of(keyed), lost))
    rc = to_run_config(cfg.replace(out=str(out), data_seed=None),
                       FlowerOptions(round_timeout=30, poll_interval=0.05, min_replies=asked - 1))
    grid = InProcessGrid(module.app, rc, cfg.data.clients, node_config={"data-seed": 0})
    try:
        sim, summary = run_server(grid, Context(run_id=1, node_id=1, node_config={},
                                                state=RecordDict(), run_config=rc))
    finally:
        module.train_client = real
    return sim, summary, lost


def solve(directory: Path, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares over the released count sums, the public totals and the key holder's
    own counts: (estimate per client, which clients are determined)."""
    clients = truth.shape[0]
    rows, sums, senders = [], [], {}
    for e in load_transcript(directory):
        key = (e["round"], e["label"], e.get("attempt", 0))
        if e["view"] == "ciphertext":
            senders.setdefault(key, set()).add(e["client"])
        elif e["view"] == "aggregate" and "count" in e.get("tensors", {}):
            rows.append([float(c in senders.get(key, ())) for c in range(clients)])
            sums.append(e["tensors"]["count"].double().numpy())
    rows += [[1.0] * clients, [float(c == 0) for c in range(clients)]]
    sums += [truth.sum(0), truth[0]]
    a, b = np.asarray(rows), np.asarray(sums)
    estimate = np.linalg.lstsq(a, b, rcond=None)[0]
    determined = np.isclose(np.diag(np.linalg.pinv(a) @ a), 1.0, atol=1e-9)
    return estimate, determined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--participation", type=float, default=1.0)
    parser.add_argument("--victim", type=int, default=4)
    parser.add_argument("--dp-eps", type=float, default=None)
    args = parser.parse_args()
    cfg = settings(args)
    sim, summary, lost = run_with_lost_node(cfg, args.victim)
    exp = build_experiment(cfg)
    truth = np.stack([np.bincount(exp.data.y_train[p].cpu().numpy(), minlength=10)
                      for p in exp.parts]).astype(float)
    estimate, determined = solve(sim.transcript.directory, truth)
    print(json.dumps({
        "lost_round": lost, "victim": args.victim, "dp_eps": args.dp_eps,
        "determined": [int(c) for c in np.where(determined)[0]],
        "victim_max_error": float(np.abs(estimate[args.victim] - truth[args.victim]).max()),
        "whole_run": {k: summary["privacy"]["whole_run"][k] for k in ("holds", "isolated")},
        "skipped": summary["skipped_releases"],
        "rejected": [(r["round"], r["client"]) for r in summary["rejected_uploads"]]}))


if __name__ == "__main__":
    main()
