"""privfedcal.flower.plugin.client: the node's handlers on a user's own ClientApp. A node
takes its protection from its own settings, whatever a server's message asks; it releases
no more than its ledger planned; only the key holder answers key queries."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from loopback import NODE_BASE, LoopbackGrid  # noqa: E402
from plugin_app import NODES, Net, make_client_app, trainloader  # noqa: E402

from privfedcal.calibration.ccvr import CCVR_RELEASE, StatsTask  # noqa: E402
from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.experiment import calibrator_class  # noqa: E402
from privfedcal.flower.plugin import CalibrationClient  # noqa: E402
from privfedcal.flower.plugin import data as plugin_data  # noqa: E402
from privfedcal.flower.plugin.plugin_settings import gather, resolve  # noqa: E402
from privfedcal.flower.records import record_to_state, state_to_record  # noqa: E402
from privfedcal.flower.tasks import task_to_records  # noqa: E402
from privfedcal.models.head_adapter import HeadAdapter  # noqa: E402
from privfedcal.privacy.dp import L2Clip  # noqa: E402
from privfedcal.privacy.planner import build_uplink  # noqa: E402
from privfedcal.privacy.stages import NoiseStage  # noqa: E402

RUN = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0}


def _ask(grid, node: int, message_type: str, content: RecordDict) -> Message:
    msg = Message(content, dst_node_id=NODE_BASE + node, message_type=message_type,
                  group_id="test")
    (reply,) = grid.pull_messages(grid.push_messages([msg]))
    return reply


def _payload_query(model, **config) -> RecordDict:
    state = HeadAdapter(model, "fc3").state_dict()
    return RecordDict({"state": state_to_record(state),
                       "config": ConfigRecord({"round": 1, "label": CCVR_RELEASE, **config}),
                       **task_to_records(StatsTask(10))})


def test_a_server_asking_for_a_weaker_epsilon_is_not_obeyed():
    grid = LoopbackGrid(make_client_app(), RUN, NODES)
    torch.manual_seed(1)
    model = Net()
    # a server that writes a weaker release into its message: the node never reads it
    reply = _ask(grid, 0, "query.payload",
                 _payload_query(model, **{"dp-eps": 100.0, "privfedcal.dp-eps": 100.0,
                                          "dp-clip": 1e6}))
    assert not reply.has_error()
    got = record_to_state(reply.content["payload"])
    true = plugin_data.compute(StatsTask(10), HeadAdapter(model, "fc3").eval(),
                               trainloader(0), L2Clip({"feature": 5.0}))
    # the noise the node's own settings plan (epsilon 8), independently of the message
    own = resolve(gather({}, RUN), clients=NODES)
    planned = type("Planned", (), {"num_examples": 1, "spec": None})
    dp = build_uplink(own.cfg, planned, calibrator_class(own.cfg)).find(NoiseStage).dp
    want = dp.stds(["count", "sum", "outer"], CCVR_RELEASE)["sum"]
    weak = resolve(gather({"dp_eps": 100.0, "dp_clip": 5.0}, {}), clients=NODES)
    weak_std = build_uplink(weak.cfg, planned, calibrator_class(weak.cfg)).find(
        NoiseStage).dp.stds(["count", "sum", "outer"], CCVR_RELEASE)["sum"]
    measured = float((got["sum"] - true["sum"]).std())
    assert 0.7 * want < measured < 1.4 * want  # 160 entries: the estimate is within ~6 %
    assert measured > 2 * weak_std  # what the message asked for would be far less noise
    # its ledger planned one release: a second one is refused with its code only
    again = _ask(grid, 0, "query.payload", _payload_query(model))
    assert again.has_error() and again.error.reason == "budget-exhausted"


def test_a_task_other_than_the_release_declares_is_refused():
    from privfedcal.calibration.creff import GradTask

    grid = LoopbackGrid(make_client_app(), RUN, NODES)
    content = _payload_query(Net())
    content.update(task_to_records(GradTask(torch.zeros(10, 16), None, 10)))
    reply = _ask(grid, 1, "query.payload", content)
    assert reply.has_error() and reply.error.reason == "refused-by-policy"


def test_hello_reports_size_and_settings_and_only_the_key_holder_makes_keys():
    grid = LoopbackGrid(make_client_app(), {**RUN, "privfedcal.secagg": True}, NODES)
    hello = _ask(grid, 2, "query.hello", RecordDict())
    assert int(hello.content["meta"]["partition-id"]) == 2
    assert int(hello.content["metrics"]["num-examples"]) == len(trainloader(2).dataset)
    want = resolve(gather({}, {**RUN, "privfedcal.secagg": True}), clients=NODES).digest()
    assert hello.content["meta"]["settings"] == want
    params = '{"poly_modulus_degree": 8192}'
    refused = _ask(grid, 1, "query.keygen", RecordDict({"config": ConfigRecord(
        {"release": "ccvr-stats-1", "params": params})}))
    assert refused.has_error() and refused.error.reason == "bad-config"


def test_attach_refuses_a_second_registration_and_bad_arguments():
    app = ClientApp()
    CalibrationClient(Net, [], head="fc3").attach(app)
    with pytest.raises(UsageError, match="cannot register query.hello"):
        CalibrationClient(Net, [], head="fc3").attach(app)
    with pytest.raises(UsageError, match="unknown privfedcal setting 'epsilon'"):
        CalibrationClient(Net, [], epsilon=1.0)
    with pytest.raises(UsageError, match="batch_size"):
        CalibrationClient(Net, [], batch_size=0)


def _clip_query(model, **config) -> RecordDict:
    state = HeadAdapter(model, "fc3").state_dict()
    return RecordDict({"state": state_to_record(state), "config": ConfigRecord(config)})


def test_a_node_sends_each_clip_stage_once_and_takes_a_clip_in_range():
    run = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": "auto"}
    grid = LoopbackGrid(make_client_app(), run, NODES)
    model = Net()
    first = _ask(grid, 0, "query.clip", _clip_query(model, stage=1))
    counts = record_to_state(first.content["histogram"])["counts"]
    auto = resolve(gather({}, run), clients=NODES).auto_clip
    assert counts.shape == (auto.search.first_edges().numel() + 1,)
    # asked again (a server restarted within the run), the node re-sends what it released
    again = _ask(grid, 0, "query.clip", _clip_query(model, stage=1))
    assert torch.equal(record_to_state(again.content["histogram"])["counts"], counts)
    second = _ask(grid, 0, "query.clip", _clip_query(model, stage=2, centre=2.0))
    resent = _ask(grid, 0, "query.clip", _clip_query(model, stage=2, centre=2.0))
    assert torch.equal(record_to_state(resent.content["histogram"])["counts"],
                       record_to_state(second.content["histogram"])["counts"])
    # around another centre it would be a new release on another grid: refused
    other = _ask(grid, 0, "query.clip", _clip_query(model, stage=2, centre=3.0))
    assert other.has_error() and other.error.reason == "budget-exhausted"
    # a payload before the clip is known is refused; a clip outside the search's range too
    early = _ask(grid, 0, "query.payload", _payload_query(model))
    assert early.has_error() and early.error.reason == "bad-config"
    wild = _ask(grid, 0, "query.clip", RecordDict({"config": ConfigRecord(
        {"stage": 3, "clip": 1e9})}))
    assert wild.has_error() and wild.error.reason == "bad-config"
    ok = _ask(grid, 0, "query.clip", RecordDict({"config": ConfigRecord(
        {"stage": 3, "clip": 4.0})}))
    assert not ok.has_error()
    assert not _ask(grid, 0, "query.payload", _payload_query(model)).has_error()
    # a node whose clip is a number sends no histogram
    fixed = LoopbackGrid(make_client_app(), RUN, NODES)
    refused = _ask(fixed, 1, "query.clip", _clip_query(model, stage=1))
    assert refused.has_error() and refused.error.reason == "refused-by-policy"
