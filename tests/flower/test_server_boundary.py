"""The Flower ServerApp holds no training data, no partition and no data seed: it builds the
server's experiment (model and public test set), takes client sizes from the nodes, checks
their data settings by digest, and refuses a data seed in its own run config on a protected
run (docs/threat-model.md, "The partition is the clients' secret")."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.federation.setup import partition_settings_digest  # noqa: E402


def test_the_server_holds_no_training_data_or_partition(flower_cfg, run_flower, run_simulator):
    cfg = flower_cfg(method="ccvr", secagg=True, hide_counts=True, transcript=True, clients=3)
    sim, _ = run_simulator(cfg)
    fl, _, grid = run_flower(cfg)
    assert fl.exp.parts is None and fl.exp.counts is None
    assert fl.exp.data.x_train.numel() == 0 and fl.exp.data.y_train.numel() == 0
    # nor the seed that would redraw the partition
    assert fl.exp.record["data_seed"] is None and fl.exp.data_options.data_seed is None
    assert fl.exp.num_examples == sim.exp.num_examples  # the public size both plan with
    # nor the clients' sizes: under --hide-counts a size would split its cohort's hidden
    # counts, so the nodes report 0 and the updates are averaged uniformly
    assert fl.sizes == {c: 0 for c in range(cfg.data.clients)}
    assert all(int(p.numel()) > 0 for p in sim.exp.parts)
    run_dir = fl.run_dir
    assert not (run_dir / "private").exists()
    assert not list(run_dir.rglob("partition.json"))


def test_a_node_with_other_data_settings_is_refused(flower_cfg, run_flower):
    from loopback import LoopbackGrid

    from privfedcal.flower.link import FlowerRoundError

    cfg = flower_cfg()
    other = cfg.replace(alpha=cfg.data.alpha * 2)
    assert partition_settings_digest(other) != partition_settings_digest(cfg)
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.records import to_run_config

    # the nodes run alpha x 2, the server's run config says alpha
    grid = LoopbackGrid(client_app, to_run_config(other.replace(data_seed=None)), cfg.data.clients,
                        node_config={"data-seed": 0})
    with pytest.raises(FlowerRoundError, match="another dataset/partition config"):
        run_flower(cfg, grid=grid)


def test_a_data_seed_in_the_servers_run_config_is_refused_under_a_protection(flower_cfg,
                                                                            tmp_path):
    from privfedcal.flower.records import to_run_config
    from privfedcal.flower.server_app import build_server

    for protected in ({"secagg": True, "method": "ccvr", "clients": 3}, {"dp_eps": 4.0, "method": "ccvr"},
                      {"dp_train": True, "dp_eps": 4.0}):
        cfg = flower_cfg(**protected, out=str(tmp_path / "run"))  # data_seed=0
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config=to_run_config(cfg))
        with pytest.raises(UsageError, match="data-seed is in the run config"):
            build_server(None, ctx)
    # a plain run's partition is public: its data seed may sit in the run config
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                  run_config=to_run_config(flower_cfg(out=str(tmp_path / "plain"))))
    assert build_server(_NoGrid(), ctx).exp.record["data_seed"] == 0


class _NoGrid:
    """build_server only stores the grid; nothing is sent in this test."""


def test_a_node_takes_the_data_seed_from_its_config_or_environment(flower_cfg, monkeypatch):
    from privfedcal.flower.client_app import DATA_SEED_ENV, node_data_seed

    def ctx(**node):
        return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})

    protected = flower_cfg(method="ccvr", secagg=True, clients=3, data_seed=None)
    monkeypatch.delenv(DATA_SEED_ENV, raising=False)
    with pytest.raises(UsageError, match="data-seed=S"):
        node_data_seed(ctx(), protected)
    assert node_data_seed(ctx(**{"data-seed": 7}), protected).data_seed == 7
    monkeypatch.setenv(DATA_SEED_ENV, "9")
    assert node_data_seed(ctx(), protected).data_seed == 9
    assert node_data_seed(ctx(**{"data-seed": 7}), protected).data_seed == 7  # config wins
    monkeypatch.setenv(DATA_SEED_ENV, "nine")
    with pytest.raises(UsageError, match="not an integer"):
        node_data_seed(ctx(), protected)
    monkeypatch.delenv(DATA_SEED_ENV)
    plain = flower_cfg(data_seed=None)
    assert node_data_seed(ctx(), plain).data_seed is None  # a plain run splits with --seed


def test_a_node_runs_one_thread_unless_told(flower_cfg):
    """Several SuperNodes on one machine must not each take every core: one thread by
    default, the run config's ``threads``, or the node config's (which wins)."""
    from privfedcal.flower.client_app import node_threads

    def ctx(**node):
        return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})

    assert node_threads(ctx(), flower_cfg(threads=None)) == 1
    assert node_threads(ctx(), flower_cfg(threads=3)) == 3
    assert node_threads(ctx(threads=4), flower_cfg(threads=3)) == 4
    with pytest.raises(UsageError, match="threads"):
        node_threads(ctx(threads="all"), flower_cfg())
