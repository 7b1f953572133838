"""privfedcal.flower.plugin.preflight: every mistake a Flower user can make with the plugin
is one line on the server, naming the node, the reason and the fix, before the first FedAvg
round of an app that trains several (counted: 0 rounds run), over the in-process Grid."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import Context, MetricRecord  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402
from plugin_app import NODES, Net, eval_loader, fedavg, make_client_app, node_data  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.grid import InProcessGrid  # noqa: E402
from privfedcal.flower.plugin import CalibrationClient, calibrate, preflight  # noqa: E402
from privfedcal.flower.plugin.preflight_codes import FIX, PreflightCode  # noqa: E402
from privfedcal.settings.messages import SettingError  # noqa: E402

pytestmark = pytest.mark.flower


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    """calibrate's default run folder goes under the working folder."""
    monkeypatch.chdir(tmp_path)
DP = {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0}
#: the run config's keys left empty: unset (the nodes' keywords hold)
NO_DP = {"privfedcal.dp-eps": "", "privfedcal.dp-clip": ""}


class CountingGrid(InProcessGrid):
    """The in-process Grid, counting the FedAvg rounds the user's strategy ran."""

    rounds = 0

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" for m in messages):
            self.rounds += 1
        return super().push_messages(messages)


def server_app(**kwargs) -> ServerApp:
    """The user's ServerApp: preflight, three FedAvg rounds, calibrate."""
    app = ServerApp()
    kwargs.setdefault("head", "fc3")

    @app.main()
    def main(grid, context):
        preflight(grid, Net(), context, test_data=eval_loader(), **kwargs)
        model = fedavg(grid, rounds=3)
        context.state["summary"] = MetricRecord({"accuracy": calibrate(
            grid, model, context, test_data=eval_loader(), **kwargs)["accuracy"]})

    return app


class Femnist(Dataset):
    """FEMNIST-style samples: ``{"image", "character"}``."""

    def __init__(self, loader: DataLoader) -> None:
        self.pairs = [(x, y) for bx, by in loader for x, y in zip(bx, by, strict=True)]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i):
        return {"image": self.pairs[i][0], "character": self.pairs[i][1]}


def femnist_data(context: Context) -> DataLoader:
    return DataLoader(Femnist(node_data(context)), batch_size=64)


def rgb_data(context: Context) -> DataLoader:
    x = torch.zeros(8, 3, 8, 8)
    return DataLoader(list(zip(x, torch.zeros(8, dtype=torch.long), strict=True)), batch_size=4)


def client_app(model=Net, data=node_data, **kwargs) -> ClientApp:
    """``make_client_app``'s training with the plugin's client as given."""
    app = make_client_app()
    fresh = ClientApp()
    fresh._registered_funcs = {k: v for k, v in app._registered_funcs.items()
                               if not k.startswith("query.")}
    CalibrationClient(model, data, **{"head": "fc3", **kwargs}).attach(fresh)
    return fresh


def run(client, run_config=None, nodes=NODES, **server_kwargs):
    grid = CountingGrid(client, {**DP, **(run_config or {})}, nodes)
    with pytest.raises(UsageError) as err:
        grid.run_server_app(server_app(**server_kwargs))
    message = str(err.value)
    assert grid.rounds == 0, "the failure came after training"
    assert "\n" not in message and "--dp" not in message and "--secagg" not in message
    return message


@pytest.mark.parametrize("client,needle", [
    (dict(head="nope"), "node 1000 (partition-id 0): the model has no Linear head"),
    (dict(head="fc2"), "give head= the name of the Linear layer the model predicts with"),
    (dict(data=femnist_data), "batch_keys=('image', 'character')"),
    (dict(data=rgb_data), "the model's forward fails on a batch of the node's data"),
    (dict(dp_eps=4.0, dp_clip=5.0), "runs other privfedcal settings than the server"),
    (dict(model=lambda: 3), "could not build its model"),
])
def test_a_node_mistake_is_named_before_round_one(client, needle):
    assert needle in run(client_app(**client), NO_DP)


def test_epsilon_0_as_a_nodes_keyword_names_the_key():
    message = run(client_app(dp_eps=0, dp_clip=5.0), NO_DP)
    assert message.startswith("node 1000 (partition-id 0): its privfedcal setting "
                              "privfedcal.dp-eps is not valid on the node"), message
    assert "CalibrationClient's dp_eps=" in message


def test_every_node_code_has_its_fix():
    assert set(FIX) == set(PreflightCode) - {PreflightCode.OK}
    assert all(":" in text for text in FIX.values())


@pytest.mark.parametrize("run_config,nodes,server,needle", [
    (NO_DP, NODES, dict(dp_eps=0), "privfedcal.dp-eps must be in (0, 100]"),
    ({"privfedcal.secagg": True}, 2, {}, "fewer than privfedcal.secagg-min-clients=2 plus "
                                         "the key holder"),
    ({"privfedcal.secagg": True}, 1, {}, "fewer than privfedcal.secagg-min-clients=2"),
    ({}, NODES, dict(head="conv1"), "not a torch.nn.Linear"),
    ({"privfedcal.bogus": 1}, NODES, {}, "unknown privfedcal setting 'bogus'"),
])
def test_a_server_mistake_is_one_line_before_round_one(run_config, nodes, server, needle):
    assert needle in run(client_app(), run_config, nodes, **server)


def test_a_node_without_the_plugin_is_named():
    assert "attach CalibrationClient(...) to its ClientApp" in run(make_client_app_plain())


def make_client_app_plain() -> ClientApp:
    app = make_client_app()
    plain = ClientApp()
    plain._registered_funcs = {k: v for k, v in app._registered_funcs.items()
                               if not k.startswith("query.")}
    return plain


def test_an_empty_run_config_value_is_unset():
    """``privfedcal.dp-eps = ""`` is no DP, as documented: the app trains and calibrates."""
    grid = CountingGrid(client_app(), NO_DP, NODES)
    context = grid.run_server_app(server_app())
    assert grid.rounds == 3 and context.state["summary"]["accuracy"] > 0.5


def test_a_failed_calibration_leaves_the_trained_model(monkeypatch):
    from privfedcal.flower.plugin import server_calibration

    grid = InProcessGrid(client_app(), DP, NODES)
    model = fedavg(grid, rounds=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def broken(*args, **kwargs):
        model.fc3.weight.data.zero_()  # a half-installed head, then a failure
        raise SettingError("{dp_eps} broke")

    monkeypatch.setattr(server_calibration.PluginSimulator, "run_calibration", broken)
    with pytest.raises(UsageError, match=r"^privfedcal.dp-eps broke$"):
        calibrate(grid, model, None, head="fc3", test_data=eval_loader(), out=None,
                  **{"dp_eps": 8.0, "dp_clip": 5.0, "clients": NODES})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class RecordingGrid(InProcessGrid):
    """Keeps (record, key, value) of every ``query.preflight`` reply."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, object]] = []

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.seen += [(name, key, value) for r in replies
                      if r.metadata.message_type == "query.preflight" and not r.has_error()
                      for name, record in r.content.items() for key, value in record.items()]
        return replies


def test_every_field_of_a_preflight_reply_is_declared():
    """What a node answers is declared (privacy/client_fields.py), its check a listed code."""
    from privfedcal.attacks.fields_table import declared

    seen = []
    for client in (client_app(), client_app(data=femnist_data),
                   client_app(dp_eps=0, dp_clip=5.0)):
        grid = RecordingGrid(client, NO_DP, NODES)
        try:
            preflight(grid, Net(), None, head="fc3", test_data=eval_loader(), clients=NODES)
        except UsageError:
            pass
        seen += grid.seen
    assert {v for r, k, v in seen if k == "check"} == {"ok", "batch-keys", "bad-setting"}
    for record, key, value in seen:
        row = declared("query.preflight", record, key)
        assert row is not None, (record, key)
        if key == "check":
            assert value in row.holds
    assert set(PreflightCode) <= set(
        declared("query.preflight", "preflight", "check").holds.replace(")", ",").replace(
            ":", ",").replace(" ", "").split(","))


def test_a_passing_preflight_returns_the_sizes_and_leaves_the_model():
    from plugin_app import digits

    grid = CountingGrid(client_app(), DP, NODES)
    model = Net().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sizes = preflight(grid, model, None, head="fc3", test_data=eval_loader(), dp_eps=8.0,
                      dp_clip=5.0)
    assert sorted(sizes) == list(range(NODES))
    assert sum(sizes.values()) == len(digits().y_train)
    assert model.training and grid.rounds == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_nodes_unknown_key_and_missing_partition_id_are_named():
    from flwr.app import RecordDict

    from privfedcal.flower.plugin.preflight import check_node

    grid = CountingGrid(client_app(), NO_DP, NODES, node_config={"privfedcal.dp-epss": 8.0})
    with pytest.raises(UsageError, match=r"^node 1000 \(partition-id 0\): its run config or "
                                         "node config has a privfedcal.\\* key the plugin"):
        grid.run_server_app(server_app())
    assert grid.rounds == 0
    client = CalibrationClient(Net, node_data, head="fc3")
    bare = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    assert check_node(client, bare) == ((PreflightCode.NO_PARTITION, ""), "", 0)
    assert "--node-config 'partition-id=K num-partitions=N'" in FIX[PreflightCode.NO_PARTITION]
