"""Every field a client sends over Flower's wire is declared in privacy/client_fields.py.

The real ServerApp and ClientApp run over a ``LoopbackGrid`` (every message serialised and
inflated as through a SuperLink); each reply that comes back is walked record by record and
key by key. A field that is not declared (``attacks/fields_table.py``: the fixed fields and the
declared releases' payload keys) fails the test, so a new field
cannot leave a client without a line in docs/threat-model.md's table.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from loopback import LoopbackGrid  # noqa: E402

from privfedcal.attacks.fields_table import client_fields, declared  # noqa: E402


class RecordingGrid(LoopbackGrid):
    """A loopback grid that keeps (message type, record, key, value) of every reply."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, str, object]] = []
        self.types: set[str] = set()

    def pull_messages(self, message_ids):
        replies = super().pull_messages(message_ids)
        for reply in replies:
            if reply.has_error():
                continue
            self.types.add(reply.metadata.message_type)
            for record_name, record in reply.content.items():
                for key, value in record.items():
                    self.seen.append((reply.metadata.message_type, record_name, key, value))
        return replies


def walk(cfg, run_flower, hold=0.0):
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.records import FlowerOptions, to_run_config

    options = FlowerOptions(hold=hold)
    grid = RecordingGrid(client_app, to_run_config(cfg, options), cfg.clients)
    run_flower(cfg, grid, options)
    assert grid.seen, "no reply was recorded"
    undeclared = sorted({f"{m}/{r}/{k}" for m, r, k, _ in grid.seen if declared(m, r, k) is None})
    assert undeclared == [], "fields sent but not declared in privacy/client_fields.py: " \
        + ", ".join(undeclared)
    # a reply with no record (query.hold) is a release too: its message must have a row
    listed = {f.message for f in client_fields()}
    unlisted = sorted(grid.types - listed)
    assert unlisted == [], "replies without a row in privacy/client_fields.py: " \
        + ", ".join(unlisted)
    return grid.seen


@pytest.mark.parametrize("flags", [
    dict(method="ccvr", dp_eps=8.0, secagg=True, hide_counts=True, dp_train=True),
    dict(method="creff", dp_eps=8.0, secagg=True, hide_counts=True),
    dict(method="ccvr", dp_eps=8.0),
    dict(method="creff"),
], ids=["ccvr-all-protections", "creff-secagg", "ccvr-dp-plain", "creff-plain"])
def test_every_field_a_client_sends_is_declared(flags, flower_cfg, run_flower):
    cfg = flower_cfg(rounds=1, clients=3, **flags)
    seen = walk(cfg, run_flower)
    messages = {m for m, _, _, _ in seen}
    assert {"train", "query.payload"} <= messages
    if cfg.secagg:
        assert {"query.keygen", "query.decrypt"} <= messages
        # under secure aggregation no payload tensor leaves a client in the clear
        assert not [k for m, r, k, _ in seen if m == "query.payload" and r == "payload"]
    if cfg.dp_train:
        # DP-SGD: no loss, and the size a client reports carries nothing
        assert not [k for m, r, k, _ in seen if k == "train-loss"]
        assert {v for m, r, k, v in seen if k == "num-examples"} == {0}


def test_the_walk_fails_on_an_undeclared_field(flower_cfg, run_flower, monkeypatch):
    """The check can fail: a client that adds one metric is caught."""
    from flwr.app import MetricRecord

    import privfedcal.flower.client_app as client_app

    original = client_app._reply

    def leaky(msg, rt, **records):
        if "metrics" in records:
            records["metrics"] = MetricRecord({**records["metrics"], "private-extra": 1.0})
        return original(msg, rt, **records)

    monkeypatch.setattr(client_app, "_reply", leaky)
    with pytest.raises(AssertionError, match="train/metrics/private-extra"):
        walk(flower_cfg(rounds=1, method="fedavg"), run_flower)


def test_a_hold_reply_has_its_row(flower_cfg, run_flower, monkeypatch):
    """flower.hold's empty replies are declared; without their row the walk fails."""
    import privfedcal.privacy.client_fields as fields

    cfg = flower_cfg(rounds=1, method="ccvr")
    walk(cfg, run_flower, hold=0.01)
    monkeypatch.setattr(fields, "FIXED_FIELDS", tuple(
        f for f in fields.FIXED_FIELDS if f.message != "query.hold"))
    with pytest.raises(AssertionError, match="replies without a row.*query.hold"):
        walk(cfg, run_flower, hold=0.01)


def test_local_evaluation_is_refused_under_dp(flower_cfg):
    """The evaluate handler answers with the local loss and accuracy, outside any budget:
    under DP a client refuses it."""
    from flwr.app import RecordDict

    from privfedcal.federation.setup import build_experiment
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import FlowerRoundError, GridLink
    from privfedcal.flower.records import FlowerOptions, state_to_record, to_run_config

    for flags, refused in ((dict(dp_eps=8.0, method="ccvr"), True), (dict(), False)):
        cfg = flower_cfg(rounds=1, **flags)
        grid = LoopbackGrid(client_app, to_run_config(cfg), cfg.clients)
        link = GridLink(grid, cfg.clients, FlowerOptions(round_timeout=5))
        exp = build_experiment(cfg)
        content = RecordDict({"global": state_to_record(exp.model.state_dict())})
        if refused:
            with pytest.raises(FlowerRoundError, match="refused under DP"):
                link.exchange(content, [0], "evaluate", "eval")
        else:
            reply = link.exchange(content, [0], "evaluate", "eval")[0].content
            assert set(reply["metrics"]) == {"num-examples", "loss", "accuracy"}
