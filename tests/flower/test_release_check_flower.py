"""A node lost during training cannot single itself out (docs/threat-model.md, "Secure
aggregation over a whole run"): CReFF with hidden counts over the in-process grid, the key
holder client 0, ``flower.min-replies`` letting a round go on without one node. The lost
node's error reply to one round's ``train`` means the server asks the others alone for
CReFF's upload; its whole public cohort then leaves that round's secure sum, every released
sum is a union of whole cohorts, the run's record holds, and least squares over the server's
transcript (with the key holder's own counts) determines no client's hidden counts.

Two runs from the report: 6 clients at participation 1.0 (cohorts (0, 1, 2), (3, 4, 5);
client 4 lost in round 2), and 12 clients at participation 0.5 (client 6 lost in the first
round after the first that selects it), each with and without ``--dp-eps 8``."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from test_whole_run_flower import CREFF, least_squares  # noqa: E402

from privfedcal.privacy.cohorts import cohort_plan, select_clients  # noqa: E402
from privfedcal.settings.floors import PrivacyOptions


def lost_round(cfg, victim: int) -> int:
    """The first round after round 1 whose selection holds ``victim`` (Flower's key holder
    is client 0: the cohorts are those of ``secagg_key_holder=0``)."""
    keyed = cfg.replace(secagg_key_holder=0)
    return next(r for r in range(2, cfg.training.rounds + 1) if victim in select_clients(PrivacyOptions.of(keyed), r))


def run_with_lost_node(cfg, victim, run_flower, monkeypatch):
    """Run ``cfg`` over the in-process grid, ``victim``'s node failing on one round's
    ``train`` message (an error reply: the ClientApp's code only); min-replies: all but one
    of a round's clients."""
    from privfedcal.flower import client_app as module
    from privfedcal.flower.records import FlowerOptions

    lost = lost_round(cfg, victim)
    real = module.train_client

    def train_client(*args):
        round_, client = args[-2:]
        if (round_, client) == (lost, victim):
            raise RuntimeError("the node crashed in training")
        return real(*args)

    monkeypatch.setattr(module, "train_client", train_client)
    asked = len(select_clients(PrivacyOptions.of(cfg.replace(secagg_key_holder=0)), lost))
    options = FlowerOptions(round_timeout=30, poll_interval=0.05, min_replies=asked - 1)
    sim, summary, _ = run_flower(cfg, options=options)
    return sim, summary, lost


def check_nothing_isolated(sim, summary, victim, lost):
    from privfedcal.privacy.transcript import secure_participants

    assert [(d["client"], d["message"], d["group"]) for d in summary["dropped_clients"]] == \
        [(victim, "train", str(lost))]
    record = summary["privacy"]["whole_run"]
    assert record["holds"] is True and record["observer_knows"] == [0]
    for known in ((), (0,)):  # the server; the key holder, who knows its own counts
        _, determined = least_squares(sim, known)
        assert not determined[[c for c in range(sim.loop.data.clients) if c not in known]].any()
    cohorts = [set(c) for c in summary["privacy"]["secagg"]["cohorts"]]
    (mates,) = [c - {victim} for c in cohorts if victim in c]
    # the lost node's cohort mates were asked and uploaded, and left the sum with it
    left_out = {r["client"] for r in summary["rejected_uploads"] if r["round"] == lost}
    assert left_out == mates
    assert all("cohort" in r["reason"] for r in summary["rejected_uploads"])
    rows = secure_participants(sim.transcript.entries)
    assert rows and all(set(row) == set().union(*[c for c in cohorts if c <= set(row)])
                        for row in rows)


@pytest.mark.flower
@pytest.mark.parametrize("dp", [None, 8.0], ids=["no-dp", "dp-eps-8"])
def test_a_node_lost_in_training_takes_its_cohort_out(flower_cfg, run_flower, monkeypatch,
                                                     dp):
    cfg = flower_cfg(method="creff", secagg=True, hide_counts=True, clients=6,
                     participation=1.0, rounds=3, transcript=True, **({} if dp is None else {"dp_eps": dp}),
                     calibration_params=CREFF)
    assert cohort_plan(PrivacyOptions.of(cfg.replace(secagg_key_holder=0))).cohorts == ((0, 1, 2), (3, 4, 5))
    sim, summary, lost = run_with_lost_node(cfg, 4, run_flower, monkeypatch)
    assert lost == 2
    check_nothing_isolated(sim, summary, 4, lost)
    aggregates = [e for e in sim.transcript.entries
                  if e["view"] == "aggregate" and e["round"] == lost]
    assert [e["clients"] for e in aggregates] == [3]  # cohort (0, 1, 2) alone


@pytest.mark.flower
@pytest.mark.parametrize("dp", [None, pytest.param(8.0, marks=pytest.mark.slow)],
                         ids=["no-dp", "dp-eps-8"])
def test_a_node_lost_at_half_participation_takes_its_cohort_out(flower_cfg, run_flower,
                                                                monkeypatch, dp):
    cfg = flower_cfg(method="creff", secagg=True, hide_counts=True, clients=12,
                     participation=0.5, rounds=4, transcript=True, **({} if dp is None else {"dp_eps": dp}),
                     calibration_params=CREFF)
    sim, summary, lost = run_with_lost_node(cfg, 6, run_flower, monkeypatch)
    check_nothing_isolated(sim, summary, 6, lost)
    assert np.isfinite(summary["accuracy"])


@pytest.mark.flower
@pytest.mark.parametrize("contributors", [[0, 1, 2, 3, 5], [0, 1, 2, 2], None],
                         ids=["partial-cohort", "twice", "no-list"])
def test_the_key_holder_node_refuses_a_non_cohort_sum(flower_cfg, caplog, contributors):
    """The key holder node (client 0) checks the contributor list sent with
    ``query.decrypt`` against the public cohorts of its own run config, (0, 1, 2) and
    (3, 4, 5): a partial cohort, a client twice or no list at all is refused with a
    declared code, before anything is decrypted."""
    import json

    import torch
    from flwr.app import ConfigRecord, RecordDict
    from loopback import LoopbackGrid

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.privacy.error_codes import CODES
    from privfedcal.privacy.packing import PayloadLayout
    from privfedcal.privacy.secagg import CKKSParams

    cfg = flower_cfg(method="ccvr", secagg=True, clients=6)
    grid = LoopbackGrid(client_app, to_run_config(cfg), 6)
    link = GridLink(grid, 6, FlowerOptions(round_timeout=5))
    params = CKKSParams.for_magnitude(10.0, max_clients=6)
    link.exchange(RecordDict({"config": ConfigRecord(
        {"release": "r-1", "params": json.dumps(params.to_dict())})}), [0], "query.keygen", "r")
    layout = PayloadLayout.from_payload({"sum": torch.zeros(3)})
    request = {"release": "r-1", "layout": layout.to_json(), "ciphertexts": [b""]}
    if contributors is not None:
        request["contributors"] = contributors
    with caplog.at_level("ERROR", logger="privfedcal.flower.client"):
        reply = link.exchange(RecordDict({"config": ConfigRecord(request)}), [0],
                              "query.decrypt", "r")[0].content
    assert "aggregate" not in reply
    assert dict(reply["rejected"]) == {"reason": "upload-rejected-locally"}
    assert reply["rejected"]["reason"] in CODES
    want = "names no contributors" if contributors is None else "not whole cohorts"
    assert want in caplog.text  # the reason stays in the node's own log


@pytest.mark.flower
def test_the_plugins_key_holder_refuses_a_non_cohort_sum(caplog):
    """The plugin's key holder (``CalibrationClient``, client 0 of 3: one cohort (0, 1, 2))
    runs the same rule: a sum of (0, 1), cohort less a member, is refused with a code."""
    import json

    import torch
    from flwr.app import ConfigRecord, RecordDict
    from loopback import LoopbackGrid
    from plugin_app import NODES, make_client_app

    from privfedcal.flower.link import GridLink
    from privfedcal.flower.records import FlowerOptions
    from privfedcal.privacy.packing import PayloadLayout
    from privfedcal.privacy.secagg import CKKSParams

    run = {"privfedcal.secagg": True, "privfedcal.hide-counts": True}
    grid = LoopbackGrid(make_client_app(), run, NODES)
    link = GridLink(grid, NODES, FlowerOptions(round_timeout=30))
    params = CKKSParams.for_magnitude(10.0, max_clients=NODES)
    link.exchange(RecordDict({"config": ConfigRecord(
        {"release": "r-1", "params": json.dumps(params.to_dict())})}), [0], "query.keygen", "r")
    layout = PayloadLayout.from_payload({"sum": torch.zeros(3)})
    with caplog.at_level("ERROR", logger="privfedcal.flower.client"):
        reply = link.exchange(RecordDict({"config": ConfigRecord(
            {"release": "r-1", "contributors": [0, 1], "layout": layout.to_json(),
             "ciphertexts": [b""]})}), [0], "query.decrypt", "r")[0].content
    assert dict(reply["rejected"]) == {"reason": "upload-rejected-locally"}
    assert "not whole cohorts" in caplog.text
