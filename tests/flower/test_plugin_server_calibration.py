"""privfedcal.flower.plugin.server_calibration: ``calibrate`` after Flower's own FedAvg on a user's CNN
(head ``fc3``) and DataLoaders, over the in-process Grid (messages serialised as through a
SuperLink): the protections of privfedcal's own apps, its run folder, and the user's model
calibrated under its own names."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from loopback import NODE_BASE, LoopbackGrid  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402
from plugin_app import NODES, Net, eval_loader, fedavg, make_client_app  # noqa: E402

from privfedcal.attacks.fields_table import declared  # noqa: E402
from privfedcal.federation.checkpoint import load_checkpoint  # noqa: E402
from privfedcal.flower.client_app import error_reply  # noqa: E402
from privfedcal.flower.link import FlowerRoundError  # noqa: E402
from privfedcal.flower.plugin import calibrate  # noqa: E402
from privfedcal.flower.plugin.plugin_settings import gather, resolve  # noqa: E402
from privfedcal.flower.records import record_to_state, state_to_record  # noqa: E402
from privfedcal.results import summary_from_dict  # noqa: E402

pytestmark = pytest.mark.flower

PROTECTED = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0, "privfedcal.secagg": True,
             "privfedcal.hide-counts": True}


@pytest.fixture(scope="module")
def trained():
    """The user's model after three rounds of Flower's FedAvg (once for the module)."""
    torch.set_num_threads(1)
    return fedavg(LoopbackGrid(make_client_app(), {}, NODES)).state_dict()


def _model(state) -> Net:
    model = Net()
    model.load_state_dict(state)
    return model


def _context(run_config) -> Context:
    return Context(run_id=7, node_id=1, node_config={}, state=RecordDict(),
                   run_config=dict(run_config))


class RecordingGrid(LoopbackGrid):
    """A loopback grid that keeps (message type, record, key, value) of every reply to
    privfedcal's queries (the user's own ``train`` replies are the user's app's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, str, object]] = []

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        for reply in replies:
            kind = reply.metadata.message_type
            if kind.startswith("query.") and not reply.has_error():
                self.seen += [(kind, name, key, value) for name, record in reply.content.items()
                              for key, value in record.items()]
        return replies


class CorruptingGrid(LoopbackGrid):
    """A loopback grid whose node of client ``victim`` spoils its ``query.payload`` reply:
    ``nan`` (NaN in its sums), ``empty`` (no payload at all), ``garbage`` (zero bytes in
    place of its ciphertext) or ``error`` (an error reply)."""

    def __init__(self, *args, victim: int, how: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        real = self.client_app

        def app(msg: Message, context: Context) -> Message:
            reply = real(msg, context)
            if msg.metadata.message_type != "query.payload" \
                    or context.node_id != NODE_BASE + victim:
                return reply
            if how == "error":
                return error_reply(msg, RuntimeError("the node failed"))
            meta = reply.content["meta"]
            if how == "garbage":  # bytes that are no ciphertext under the release's key
                data = bytes(len(bytes(reply.content["ciphertext"]["data"])))
                return Message(RecordDict({"meta": meta, "ciphertext": ConfigRecord(
                    {"data": data})}), reply_to=msg)
            if how == "empty":
                return Message(RecordDict({"meta": meta}), reply_to=msg)
            payload = record_to_state(reply.content["payload"])
            payload["sum"] = torch.full_like(payload["sum"], math.nan)
            return Message(RecordDict({"meta": meta, "payload": state_to_record(payload)}),
                           reply_to=msg)

        self.client_app = app


def test_ccvr_with_dp_secagg_and_hidden_counts(trained, tmp_path):
    model = _model(trained)
    keys = list(model.state_dict())
    fc1, fc3 = model.fc1.weight.detach().clone(), model.fc3.weight.detach().clone()
    grid = RecordingGrid(make_client_app(), PROTECTED, NODES)
    out = tmp_path / "run"
    summary = calibrate(grid, model, _context(PROTECTED), head="fc3", test_data=eval_loader(),
                        out=out)
    # the run folder of privfedcal's own apps: summary (its documented type), server view,
    # transcript
    assert json.loads((out / "summary.json").read_text()) == summary
    summary_from_dict(summary)
    assert (out / "server" / "summary.json").is_file() and (out / "server" / "config.json").is_file()
    views = [e["view"] for e in json.loads((out / "server" / "transcript" / "index.json")
                                           .read_text())]
    assert views == ["model-state", "ciphertext", "ciphertext", "ciphertext", "aggregate"]
    # every field the nodes sent is one privfedcal's own ClientApp declares
    kinds = {m for m, _, _, _ in grid.seen}
    assert kinds == {"query.hello", "query.payload", "query.keygen", "query.decrypt"}
    undeclared = sorted({f"{m}/{r}/{k}" for m, r, k, _ in grid.seen if declared(m, r, k) is None})
    assert undeclared == []
    # the protections and their accounting
    privacy = summary["privacy"]
    assert privacy["epsilon_spent"] <= privacy["epsilon_target"] == 8.0
    assert privacy["hide_counts"] and privacy["secagg"]["min_clients"] == 3
    assert privacy["whole_run"]["holds"] and privacy["distributed_noise"]
    assert summary["rejected_uploads"] == [] and summary["dropped_clients"] == []
    # accuracy before and after, on the server's test data
    assert 0 < summary["accuracy_before_calibration"] < 1 and 0 < summary["accuracy"] < 1
    assert summary["calibration"]["name"] == "ccvr"
    # the user's model: its own names, the head re-trained, the rest untouched
    assert list(model.state_dict()) == keys
    assert torch.equal(model.fc1.weight, fc1) and not torch.equal(model.fc3.weight, fc3)
    final = load_checkpoint(out / "final", "cpu")["model"]
    assert list(final) == keys and torch.equal(final["fc3.weight"], model.fc3.weight)
    Net().load_state_dict(final)  # loads into a fresh user model as any checkpoint of it


@pytest.mark.parametrize("how", ["nan", "empty"])
def test_a_malformed_reply_is_dropped_and_named(trained, tmp_path, how):
    run = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0}
    grid = CorruptingGrid(make_client_app(), run, NODES, victim=1, how=how)
    summary = calibrate(grid, _model(trained), _context(run), test_data=eval_loader(),
                        out=tmp_path / "run")
    (rejected,) = summary["rejected_uploads"]
    assert rejected["client"] == 1 and rejected["label"] == "ccvr-stats"
    assert math.isfinite(summary["accuracy"])
    assert summary["privacy"]["epsilon_spent"] <= 8.0


def test_a_bad_ciphertext_is_named_and_the_short_secure_sum_never_made(trained, tmp_path):
    grid = CorruptingGrid(make_client_app(), PROTECTED, NODES, victim=2, how="garbage")
    model = _model(trained)
    fc3 = model.fc3.weight.detach().clone()
    summary = calibrate(grid, model, _context(PROTECTED), test_data=eval_loader(),
                        out=tmp_path / "run")
    rejected = summary["rejected_uploads"]
    # the bad upload is named, and its cohort (here every node) is left out with it
    assert rejected[0]["client"] == 2 and sorted(r["client"] for r in rejected) == [0, 1, 2]
    assert all("cohort" in r["reason"] for r in rejected[1:])
    # fewer uploads than the key holder's own plus secagg-min-clients: no release
    (skipped,) = summary["skipped_releases"]
    assert skipped["label"] == "ccvr-stats"
    assert summary["accuracy"] == summary["accuracy_before_calibration"]
    assert torch.equal(model.fc3.weight, fc3)  # the head stays as FedAvg left it


def test_a_lost_node_is_dropped_under_min_replies(trained, tmp_path):
    run = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0,
           "privfedcal.flower.min-replies": 2}
    grid = CorruptingGrid(make_client_app(), run, NODES, victim=2, how="error")
    summary = calibrate(grid, _model(trained), _context(run), test_data=eval_loader(),
                        out=tmp_path / "run")
    (lost,) = summary["dropped_clients"]
    assert lost["client"] == 2 and lost["reason"] == "internal-error"
    summary_from_dict(summary)
    # without min-replies every node must answer: the run stops naming the lost one
    grid = CorruptingGrid(make_client_app(), {**run, "privfedcal.flower.min-replies": 0},
                          NODES, victim=2, how="error")
    with pytest.raises(FlowerRoundError, match="client 2"):
        calibrate(grid, _model(trained), _context({**run, "privfedcal.flower.min-replies": 0}),
                  test_data=eval_loader(), out=tmp_path / "run2")


def test_nodes_with_other_settings_are_refused_before_any_release(trained, tmp_path):
    grid = LoopbackGrid(make_client_app(), PROTECTED, NODES,
                        node_config={"privfedcal.dp-eps": 4.0})
    with pytest.raises(FlowerRoundError, match=r"client\(s\) \[0, 1, 2\] run other"):
        calibrate(grid, _model(trained), _context(PROTECTED), test_data=eval_loader(),
                  out=tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


def test_creff_rounds_on_the_final_model(trained, tmp_path):
    run = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0, "privfedcal.rounds": 2,
           "privfedcal.secagg": True, "privfedcal.hide-counts": True,
           "privfedcal.calibration-params.match-steps": 5,
           "privfedcal.calibration-params.retrain-steps": 2,
           "privfedcal.calibration-params.features-per-class": 10}
    grid = LoopbackGrid(make_client_app(method="creff"), run, NODES)
    summary = calibrate(grid, _model(trained), _context(run), method="creff",
                        test_data=eval_loader(), out=tmp_path / "run")
    assert summary["calibrator"] == "creff"
    assert [r["steps"] for r in summary["privacy"]["releases"]] == [2]
    assert summary["privacy"]["epsilon_spent"] <= 8.0
    # two secure sums of the same cohort: the whole run isolates no one
    assert summary["privacy"]["whole_run"]["secure_sums"] == 2
    assert summary["privacy"]["whole_run"]["holds"]
    assert 0 < summary["accuracy_before_calibration"] < 1
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [1, 2]


def test_bad_arguments_are_one_line_errors_before_any_message(trained, tmp_path):
    from privfedcal.errors import UsageError

    grid = RecordingGrid(make_client_app(), {}, NODES)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "summary.json").write_text("{}")
    for kwargs, match in ((dict(out=tmp_path / "used"), "already holds a run"),
                          (dict(head="conv1"), "not a torch.nn.Linear"),
                          (dict(method="oracle"), "method must be one of ccvr, creff"),
                          (dict(test_data=None), "needs test_data")):
        args = {"test_data": eval_loader(), "out": tmp_path / "run", **kwargs}
        with pytest.raises(UsageError, match=match) as info:
            calibrate(grid, _model(trained), None, **args)
        assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="flwr Grid"):
        calibrate(object(), _model(trained), test_data=eval_loader())
    assert grid.seen == []  # nothing was asked of the nodes


def test_an_auto_clip_is_chosen_privately_within_the_budget(trained, tmp_path):
    run = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": "auto", "privfedcal.secagg": True,
           "privfedcal.hide-counts": True}
    grid = RecordingGrid(make_client_app(), run, NODES)
    out = tmp_path / "run"
    summary = calibrate(grid, _model(trained), _context(run), test_data=eval_loader(), out=out)
    clip = summary["plugin"]["feature_clip"]
    privacy = summary["privacy"]
    # the calibration release used the chosen clip; both parts stay within the run's budget
    assert privacy["feature_clip"] == clip["clip"] and 0.01 < clip["clip"] < 1e4
    # one accountant per node holds the search's two stages and the calibration, within the
    # user's one target; opacus stepped by hand with the planned multipliers
    auto = resolve(gather({}, run), clients=NODES).auto_clip
    (z,) = auto.calibration.values()
    acc = RDPAccountant()
    acc.history = [(auto.stage_sigma(1), 1.0, 1), (auto.stage_sigma(2), 1.0, 1), (z, 1.0, 1)]
    whole = acc.get_epsilon(1e-5)
    acc.history = [(z, 1.0, 1)]
    assert whole > acc.get_epsilon(1e-5) + 0.05  # the search's stages are in the sum
    assert privacy["epsilon_target"] == 8.0 and privacy["delta"] == 1e-5
    assert privacy["epsilon_spent"] == pytest.approx(whole, rel=1e-6) and whole <= 8.0
    assert privacy["per_client_epsilon"] == {str(c): privacy["epsilon_spent"]
                                             for c in range(NODES)}
    assert clip["run_epsilon"] == privacy["epsilon_spent"] and clip["run_delta"] == 1e-5
    # recomputed from the server's record alone: each node's two stages and its sum, once
    assert privacy["from_transcript"]["epsilon"] == pytest.approx(whole, rel=1e-6)
    assert privacy["from_transcript"]["repeated"] == 0
    # the server saw each node's two noisy histograms, recorded in its view
    entries = json.loads((out / "server" / "transcript" / "index.json").read_text())
    clip_entries = [e for e in entries if e["label"] == "feature-clip"]
    assert sorted(e["client"] for e in clip_entries) == [0, 0, 1, 1, 2, 2]
    assert {(m, r, k) for m, r, k, _ in grid.seen if m == "query.clip"} == {
        ("query.clip", "meta", "partition-id"), ("query.clip", "histogram", "counts")}
    assert all(declared(m, r, k) is not None for m, r, k, _ in grid.seen)
    assert json.loads((out / "summary.json").read_text()) == summary
    summary_from_dict(summary)
