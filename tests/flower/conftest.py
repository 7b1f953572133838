"""Fixtures for the Flower tests: run one config in the simulator and under Flower."""

from __future__ import annotations

import pytest


@pytest.fixture
def flower_cfg(tiny_cfg):
    """A tiny RunConfig (digits, 2 clients, 2 rounds, one thread, no transcript) with data
    seed 0, so that the simulator and the Flower nodes draw the same partition."""
    return lambda **kw: tiny_cfg(**{"clients": 2, "data_seed": 0, **kw})


@pytest.fixture
def run_simulator(tmp_path):
    """Run ``cfg`` with the in-process simulator; returns (simulator, summary)."""
    from privfedcal.experiment import build_simulator

    def run(cfg):
        out = tmp_path / "simulator"
        sim = build_simulator(cfg.replace(out=str(out)), out)
        return sim, sim.run()

    return run


@pytest.fixture
def run_flower(tmp_path):
    """Run ``cfg`` through the real ServerApp/ClientApp over a ``LoopbackGrid``; returns
    (FlowerSimulator, summary, grid). The data seed goes to the nodes' node config, as in a
    deployment: the server's run config never holds it."""
    from flwr.app import Context, RecordDict
    from loopback import LoopbackGrid

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.records import to_run_config
    from privfedcal.flower.server_app import run_server

    def run(cfg, grid=None, options=None):
        run_config = to_run_config(cfg.replace(out=str(tmp_path / "flower"), data_seed=None),
                                   options)
        nodes = {} if cfg.training.data_seed is None else {"data-seed": cfg.training.data_seed}
        grid = grid or LoopbackGrid(client_app, run_config, cfg.data.clients, node_config=nodes)
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config=run_config)
        sim, summary = run_server(grid, ctx)
        return sim, summary, grid

    return run
