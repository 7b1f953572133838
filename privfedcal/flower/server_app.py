"""The privfedcal ServerApp: the simulator's round loop, clients reached through Flower.

The run config (``[tool.flwr.app.config]``, see ``flower/records.py``) is a ``RunConfig``;
the server builds the method, calibrator and uplink with the same factories as
``privfedcal train`` and writes the same run folder (``metrics.jsonl``, ``summary.json``,
``server/transcript/``, ``checkpoint/``, ``final/``) to ``out`` (default
``runs/flower-<method>-<run id>`` under the ServerApp's working directory).

The server builds the server's experiment (``experiment.build_server_experiment``): the
model, the public test set it evaluates on and public sizes. It never holds training
samples, the partition or the data seed (which the nodes take from their node config,
``data-seed``): clients' sample counts are what the nodes report. Its run folder has
``server/`` (its view) and the experimenter's records, and no ``private/``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from privfedcal.errors import UsageError
from privfedcal.flower.flower_simulator import FlowerSimulator
from privfedcal.flower.link import GridLink
from privfedcal.flower.pulls import quick_object_pulls
from privfedcal.flower.records import parse_run_config

log = logging.getLogger("privfedcal.flower")

app = ServerApp()


def build_server(grid: Grid, context: Context) -> FlowerSimulator:
    """The ``FlowerSimulator`` for this run (data, model, method, calibrator, uplink)."""
    from privfedcal.experiment import build_parts
    from privfedcal.federation.setup import partition_is_secret
    from privfedcal.settings.floors import PrivacyOptions

    cfg, options = parse_run_config(context.run_config)
    if cfg.training.data_seed is not None and partition_is_secret(PrivacyOptions.of(cfg)):
        # the run config is the server's: a data seed in it is a partition the server holds
        raise UsageError("data-seed is in the run config, which the server reads, on a run "
                         "whose protections need a partition the server cannot redraw: give "
                         "it to every SuperNode instead (--node-config 'data-seed=S', "
                         "docs/flower.md)")
    cfg = cfg.replace(workers=1, client_batch=1)  # the nodes train; each its one client
    run_dir = (Path(cfg.output.out) if cfg.output.out
               else Path("runs") / f"flower-{cfg.method}-{context.run_id}")
    exp, calibrator, uplink = build_parts(cfg.replace(out=str(run_dir)), server=True)
    link = GridLink(grid, exp.loop.data.clients, options)
    return FlowerSimulator(exp, run_dir, link, calibrator=calibrator, uplink=uplink,
                           key_holder=options.key_holder,
                           run_record={"flower_run_id": context.run_id})


def run_server(grid: Grid, context: Context) -> tuple[FlowerSimulator, dict[str, Any]]:
    """Build, wait for the SuperNodes, run every round and the post-hoc calibration;
    returns the simulator (its ``global_state``, ``transcript``) and the run summary."""
    sim = build_server(grid, context)
    quick_object_pulls()  # a reply found mid-upload is retried after 0.05 s, not 1 s
    sim.link.wait_for_nodes()

    def progress(record: dict[str, Any]) -> None:
        acc = f" accuracy {record['accuracy']:.4f}" if "accuracy" in record else ""
        loss = record["train_loss"]
        train = "withheld (DP)" if loss is None else f"{loss:.4f}"
        log.info("round %d: train loss %s%s (%.2f s)", record["round"], train, acc,
                 record["seconds"])

    summary = sim.run(progress=progress)
    sim.link.close()  # the replies of the last holds (flower.hold), if any
    log.info("privfedcal summary: accuracy %.4f, %s", summary["accuracy"],
             json.dumps({k: summary[k] for k in ("method", "calibrator", "rounds",
                                                 "wall_seconds") if k in summary}))
    return sim, summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    if not log.handlers:  # Flower's ServerApp process logs nothing of ours otherwise
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s privfedcal: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    run_server(grid, context)
