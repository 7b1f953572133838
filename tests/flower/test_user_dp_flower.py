"""--dp-updates (user-level DP-FedAvg, privacy/user_dp.py) under privfedcal's own Flower apps,
over the loopback grid: each node clips its own update, the server clips again, sums and adds
the noise, and charges the same ledger and accountant as the simulator. Same config, same
plan: the same epsilon, the same charges and (with seeded noise) the same global model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.records import record_to_state  # noqa: E402
from privfedcal.privacy.user_dp import UserDP, model_delta, update_norm  # noqa: E402

#: central DP-FedAvg with feature DP on the calibration release, both in one budget
USER_DP = {"method": "fedavg", "dp_updates": True, "dp_eps": 8.0, "dp_update_clip": 0.5,
           "insecure_seeded_noise": True}


def _charges(sim) -> dict[int, list]:
    """Each client's accountant history (noise multiplier, rate, steps, label)."""
    return {c: acc.state_dict()["history"]
            for c, acc in sim.uplink.find(UserDP).dp.per_client.items() if c >= 0}


@pytest.mark.flower
def test_dp_updates_under_flower_is_the_simulators_accounting(flower_cfg, run_simulator,
                                                               run_flower):
    cfg = flower_cfg(**USER_DP)
    sim, summary = run_simulator(cfg)
    fl, fl_summary, grid = run_flower(cfg)
    user, fl_user = summary["privacy"]["user_dp"], fl_summary["privacy"]["user_dp"]
    assert fl_user["epsilon_spent"] == pytest.approx(user["epsilon_spent"], rel=1e-12)
    assert 0 < fl_user["epsilon_spent"] <= 8.0
    assert fl_user["noise_multiplier"] == user["noise_multiplier"]
    assert _charges(fl) == _charges(sim)  # the same releases in the same ledgers
    # seeded noise: the server's draw is the simulator's, the clip the same (up to the
    # float32 of the wire, the node's clipped update clipped again on the server)
    for key, value in sim.global_state.items():
        torch.testing.assert_close(fl.global_state[key], value, rtol=0, atol=1e-5, msg=key)
    assert all(h["train_loss"] is None for h in fl.history)
    # what a node's train handler sends: the global state moved by at most the clip, and
    # no training loss
    reply = _train_reply(grid, cfg, fl.global_state)
    sent = record_to_state(reply["local"], "cpu")
    assert update_norm(model_delta(sent, fl.global_state)) <= 0.5 * (1 + 1e-5)
    assert "train-loss" not in reply["metrics"]


def _train_reply(grid, cfg, state):
    """Client 0's reply to one more ``train`` message over ``grid``."""
    from flwr.app import ConfigRecord, RecordDict

    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions, state_to_record

    link = GridLink(grid, cfg.data.clients, FlowerOptions(round_timeout=30))
    content = RecordDict({"global": state_to_record(state), "config": ConfigRecord({"round": 3})})
    return link.exchange(content, [0], "train", "3")[0].content


@pytest.mark.flower
def test_a_node_sends_its_update_clipped(flower_cfg):
    """What the server receives from a node is within the clip of the global state."""
    from flwr.app import Context, RecordDict

    from privfedcal.flower.client_app import client_runtime, sent_update
    from privfedcal.flower.records import to_run_config

    cfg = flower_cfg(**USER_DP)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2,
                                                    "data-seed": 0},
                  state=RecordDict(), run_config=to_run_config(cfg.replace(data_seed=None)))
    uplink = client_runtime(ctx).uplink
    glob = {k: v.clone() for k, v in client_runtime(ctx).exp.model.state_dict().items()}
    far = {k: v + 3.0 if v.is_floating_point() else v for k, v in glob.items()}
    sent = sent_update(uplink, glob, far, 1, 0)
    assert update_norm(model_delta(sent, glob)) == pytest.approx(0.5, rel=1e-5)
    assert sent.keys() == glob.keys()


def test_the_adaptive_clip_is_refused_under_flower(tiny_cfg, tmp_path):
    # the nodes clip: the server cannot count the norms within the clip
    from privfedcal.experiment import build_experiment
    from privfedcal.flower.flower_simulator import FlowerSimulator

    exp = build_experiment(tiny_cfg(dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True))
    with pytest.raises(UsageError, match="adaptive-clip runs in the simulator only"):
        FlowerSimulator(exp, tmp_path, link=None)
