"""Upload protections under Flower: noise and encryption on the nodes, the same releases.

The client nodes add the uplink's own DP noise and encrypt under the key-holder node's public
key; the server adds ciphertexts with the public context only and the key holder decrypts the
sum. With --insecure-seeded-noise (noise from the seed, for this comparison only) the releases
must equal the simulator's (exactly without CKKS, within the key holder's flooding with it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from loopback import NODE_BASE  # noqa: E402

from privfedcal.flower.stage_messages import KEY_STATE  # noqa: E402


def _views(sim, label):
    from privfedcal.privacy.transcript import load_transcript

    return [e for e in load_transcript(sim.transcript.directory) if e["label"] == label]


def _calibrated(sim):
    return sim.calibrator.eval_state(sim.global_state)


def _close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].double(), b[k].double(), rtol=0, atol=atol, msg=k)


def test_dp_noise_is_added_on_the_nodes_and_matches_the_simulator(flower_cfg, run_simulator,
                                                                  run_flower):
    cfg = flower_cfg(method="ccvr", dp_eps=8.0, transcript=True, insecure_seeded_noise=True,
                     calibration_params={"virtual_per_class": 20})
    sim, summary = run_simulator(cfg)
    fl, fl_summary, grid = run_flower(cfg)
    # what the server saw of each client: the same noisy upload in both
    want, got = _views(sim, "ccvr-stats"), _views(fl, "ccvr-stats")
    assert [(e["view"], e["client"]) for e in got] == [(e["view"], e["client"]) for e in want]
    for a, b in zip(want, got, strict=True):
        if "tensors" in a:
            _close(b["tensors"], a["tensors"], atol=1e-9)
    _close(_calibrated(fl), _calibrated(sim), atol=1e-6)  # same noise, same release
    assert fl_summary["privacy"]["epsilon_spent"] == pytest.approx(
        summary["privacy"]["epsilon_spent"])
    assert fl_summary["privacy"]["epsilon_spent"] <= 8.0
    # the server's view is noisy: counts are not integers any more
    counts = [e["tensors"]["count"] for e in got if e["view"] == "plain-upload"]
    assert counts and all(not torch.equal(c, c.round()) for c in counts)
    assert fl.uplink.rejected == [] and fl.uplink.skipped == []


def test_secure_aggregation_with_a_key_holder_node(flower_cfg, run_simulator, run_flower):
    cfg = flower_cfg(method="ccvr", secagg=True, hide_counts=True, transcript=True, clients=3,
                     calibration_params={"virtual_per_class": 20})
    sim, summary = run_simulator(cfg)
    fl, fl_summary, grid = run_flower(cfg)
    # CKKS releases are flooded by the key holder (privacy/secagg.py) with noise from OS
    # entropy, fresh in every run: the aggregates agree up to that noise (below), the
    # re-trained heads only in accuracy. Over 10 simulator runs of this configuration the
    # calibrated accuracy had std 0.0043 (range 0.016), so the difference of two runs has
    # std ~0.006: 0.03 is 5 of those, where 0.01 failed about one run in ten.
    assert fl_summary["accuracy"] == pytest.approx(summary["accuracy"], abs=0.03)
    assert fl_summary["accuracy"] > fl_summary["accuracy_before_calibration"]
    views = _views(fl, "ccvr-stats")
    kinds = [r["view"] for r in views]
    assert kinds == ["model-state", "ciphertext", "ciphertext", "ciphertext", "aggregate"]
    sizes = {r["bytes"] for r in views if r["view"] == "ciphertext"}
    assert len(sizes) == 1  # hidden counts: every upload has the same padded size
    (sim_agg,) = [e for e in _views(sim, "ccvr-stats") if e["view"] == "aggregate"]
    _close(views[-1]["tensors"], sim_agg["tensors"], atol=0.5)  # flooding std ~ 0.02 here
    total = float(views[-1]["tensors"]["count"].sum())
    assert abs(total - sum(p.numel() for p in sim.exp.parts)) < 1.0
    # the key holder (client 0) dropped its one-release key after decrypting
    assert KEY_STATE not in grid.contexts[NODE_BASE].state.config_records
    assert fl_summary["privacy"]["secagg"]["params"]["ccvr-stats"]


def test_secure_aggregation_without_padding(flower_cfg, run_flower):
    """Without --hide-counts uploads travel unpadded (and are accepted)."""
    cfg = flower_cfg(method="ccvr", secagg=True, rounds=1, clients=3,
                     calibration_params={"virtual_per_class": 20})
    fl, summary, _ = run_flower(cfg)
    assert summary["rejected_uploads"] == [] and summary["skipped_releases"] == []
    assert summary["calibration"]["present_classes"] == 10


def test_dp_sgd_local_training_runs_on_the_nodes(flower_cfg, run_simulator, run_flower):
    cfg = flower_cfg(method="fedavg", dp_eps=8.0, dp_train=True, rounds=1,
                     insecure_seeded_noise=True)
    sim, summary = run_simulator(cfg)
    fl, fl_summary, _ = run_flower(cfg)
    _close(fl.global_state, sim.global_state, atol=1e-6)
    assert fl_summary["privacy"]["covers"] == summary["privacy"]["covers"]


def test_only_the_designated_node_acts_as_key_holder(flower_cfg):
    import json

    from flwr.app import ConfigRecord, RecordDict
    from loopback import LoopbackGrid

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import FlowerRoundError, GridLink
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.privacy.secagg import CKKSParams

    cfg = flower_cfg(method="ccvr", secagg=True, clients=3)  # 2 others beside the key holder
    grid = LoopbackGrid(client_app, {**to_run_config(cfg), "flower.key-holder": 1}, 3)
    link = GridLink(grid, 3, FlowerOptions(round_timeout=5))
    params = CKKSParams.for_magnitude(10.0, max_clients=2)
    content = RecordDict({"config": ConfigRecord(
        {"release": "r", "params": json.dumps(params.to_dict())})})
    with pytest.raises(FlowerRoundError, match=r"node 1000\W+bad-config"):
        link.exchange(content, [0, 1], "query.keygen", "r")
    reply = link.exchange(content, [1], "query.keygen", "r")[1].content
    assert KEY_STATE in grid.contexts[NODE_BASE + 1].state.config_records
    from privfedcal.privacy.secagg import load_public_context

    assert not load_public_context(bytes(reply["secagg"]["public-context"])).is_private()


def test_the_key_holders_refusal_is_a_code(flower_cfg, monkeypatch, caplog):
    """The key holder's check of a sum can fail on the sum's largest entry (a number of the
    decrypted data): the server is sent the code, the text stays in the node's log."""
    import json

    from flwr.app import ConfigRecord, RecordDict
    from loopback import LoopbackGrid

    import privfedcal.privacy.secagg_stage as secagg_stage
    from privfedcal.errors import UploadRejected
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.privacy.packing import PayloadLayout
    from privfedcal.privacy.secagg import CKKSParams

    def check(*args, **kwargs):
        raise UploadRejected("aggregate entry 417.3 exceeds the declared bound 10")

    monkeypatch.setattr(secagg_stage, "key_holder_release", check)
    cfg = flower_cfg(method="ccvr", secagg=True, clients=3)  # 2 others beside the key holder
    grid = LoopbackGrid(client_app, to_run_config(cfg), 3)
    link = GridLink(grid, 3, FlowerOptions(round_timeout=5))
    params = CKKSParams.for_magnitude(10.0, max_clients=2)
    link.exchange(RecordDict({"config": ConfigRecord(
        {"release": "r-1", "params": json.dumps(params.to_dict())})}), [0], "query.keygen", "r")
    layout = PayloadLayout.from_payload({"sum": torch.zeros(3)})
    with caplog.at_level("ERROR", logger="privfedcal.flower.client"):
        reply = link.exchange(RecordDict({"config": ConfigRecord(
            {"release": "r-1", "contributors": [0, 1, 2], "layout": layout.to_json(),
             "ciphertexts": [b""]})}), [0], "query.decrypt", "r")[0].content
    assert dict(reply["rejected"]) == {"reason": "upload-rejected-locally"}
    assert "417.3" in caplog.text  # the node's own log


def test_rejected_upload_is_dropped_and_noise_topped_up_under_flower(flower_cfg):
    """The Flower key holder, like the simulator's, tops the distributed noise up when an
    upload is rejected, and the release goes on with the others: the server and the nodes
    run the uplink's own stages, the key holder reached through ``RemoteKeys``."""
    from loopback import LoopbackGrid

    from privfedcal.experiment import build_experiment, calibrator_class
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.flower.stage_messages import RemoteKeys, client_upload, sealing_record
    from privfedcal.privacy.planner import build_uplink
    from privfedcal.privacy.stages import NoiseStage
    from privfedcal.privacy.transcript import Transcript

    cfg = flower_cfg(method="ccvr", clients=6, dp_eps=8.0, secagg=True, secagg_key_holder=0)
    exp = build_experiment(cfg)
    client_side = build_uplink(cfg, exp, calibrator_class(cfg))  # every node builds the same uplink
    grid = LoopbackGrid(client_app, {**to_run_config(cfg), "flower.key-holder": 0}, 6)
    link = GridLink(grid, 6, FlowerOptions(round_timeout=30))
    c, d = exp.data.num_classes, 8
    example = {"count": torch.zeros(c, dtype=torch.float64),
               "sum": torch.zeros(c, d, dtype=torch.float64),
               "outer": torch.zeros(c, d, d, dtype=torch.float64)}
    stds = client_side.find(NoiseStage).dp.stds(list(example), "ccvr-stats")
    devs, rejected, skipped = [], [], []
    iu = torch.triu_indices(d, d)
    for rep in range(4):
        server = build_uplink(cfg, exp, calibrator_class(cfg))  # a fresh budget per repetition
        server.wire.keys = RemoteKeys(link, 0)
        rel = server.release("ccvr-stats", rep + 1, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5],
                             example, Transcript(None))
        server.open(rel)
        sealing = sealing_record(rel.state["sealing"])
        ups = [(k, bytes(client_upload(client_side, example, label="ccvr-stats",
                                       round_=rep + 1, client=k,
                                       secagg=sealing)["ciphertext"]["data"]))
               for k in (0, 1, 2, 4, 5)]
        ups.insert(3, (3, b"garbage"))  # cohorts (0, 1, 2), (3, 4, 5): 4 and 5 leave with 3
        total = server.server_side(ups, rel)
        rejected += server.rejected
        skipped += server.skipped
        devs.append(total["sum"].flatten() / stds["sum"])
        devs.append((total["outer"] / stds["outer"])[:, iu[0], iu[1]].flatten())
    assert [r["client"] for r in rejected] == [3, 4, 5] * 4 and skipped == []
    var = float(torch.cat(devs).var())
    # 3 shares of 1/5 arrive (3/5), the top-up adds the 3 missing: 6/5 (3 SE either side;
    # no top-up would give 3/5); 1760 draws (SE ~ 0.05)
    assert 1.05 < var < 1.35


@pytest.mark.parametrize("flags", [{}, {"dp_eps": 8.0}, {"secagg": True, "clients": 3},
                                   {"dp_eps": 8.0, "secagg": True, "hide_counts": True,
                                    "clients": 3}],
                         ids=["clear", "noise", "encrypt", "noise+encrypt"])
def test_flower_and_simulator_run_the_same_stages(flags, flower_cfg, run_simulator,
                                                  run_flower, monkeypatch):
    """Every stage half the simulator runs, the Flower nodes, server and key holder run
    too: the same classes, the same number of calls (one release of every client; 3 under
    --secagg, where the key holder node needs two uploads besides its own)."""
    from privfedcal.privacy.stages import Stage

    calls: list[tuple[str, str]] = []
    classes = {type(s) for s in _uplink_stages(flower_cfg, flags)}
    for cls in classes:
        for half in ("open", "client", "server", "close"):
            if half in ("server",) and hasattr(cls, "deliver"):
                half = "deliver"
            original = getattr(cls, half)

            def spy(self, *args, _o=original, _n=f"{cls.__name__}.{half}", **kw):
                calls.append(_n)
                return _o(self, *args, **kw)

            monkeypatch.setattr(cls, half, spy)
    assert all(issubclass(c, Stage) for c in classes)
    cfg = flower_cfg(method="ccvr", rounds=1, insecure_seeded_noise=True,
                     calibration_params={"virtual_per_class": 20}, **flags)
    run_simulator(cfg)
    in_simulator = sorted(calls)
    calls.clear()
    run_flower(cfg)
    assert sorted(calls) == in_simulator
    assert {c.split(".")[0] for c in in_simulator} == {c.__name__ for c in classes}


def _uplink_stages(flower_cfg, flags):
    from privfedcal.experiment import build_experiment, calibrator_class
    from privfedcal.privacy.planner import build_uplink

    cfg = flower_cfg(method="ccvr", rounds=1, **flags)
    return build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg)).stages
