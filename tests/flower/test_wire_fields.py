"""Every field a client sends over Flower's wire is declared in privacy/client_fields.py.

The real ServerApp and ClientApp run over a ``LoopbackGrid`` (every message serialised and
inflated as through a SuperLink); each reply that comes back is walked record by record and
key by key, an error reply as its ``error/code`` and ``error/reason``. A field that is not
declared (``attacks/fields_table.py``: the fixed fields and the declared releases' payload
keys), or a value outside a declared vocabulary (an error's text where only a code may go),
fails the test, so a new field cannot leave a client without a line in docs/threat-model.md's
table.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

import torch  # noqa: E402
from loopback import NODE_BASE, LoopbackGrid  # noqa: E402

from privfedcal.attacks.fields_table import client_fields, declared  # noqa: E402
from privfedcal.errors import (  # noqa: E402
    Diverged,
    PrivacyBudgetError,
    ReleaseSkipped,
    UploadRejected,
    UsageError,
)


class RecordingGrid(LoopbackGrid):
    """A loopback grid that keeps (message type, record, key, value) of every reply, an
    error reply as its ``error/code`` and ``error/reason``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, str, object]] = []
        self.types: set[str] = set()

    def pull_messages(self, message_ids):
        replies = super().pull_messages(message_ids)
        for reply in replies:
            kind = reply.metadata.message_type
            if reply.has_error():  # an error reply is a release too
                self.seen += [(kind, "error", "code", reply.error.code),
                              (kind, "error", "reason", reply.error.reason)]
                continue
            self.types.add(kind)
            for record_name, record in reply.content.items():
                for key, value in record.items():
                    self.seen.append((kind, record_name, key, value))
        return replies


def check(grid: RecordingGrid) -> None:
    """Every field ``grid`` saw is declared, every value of a field with a declared
    vocabulary is in it, and every message type that replied has a row."""
    assert grid.seen, "no reply was recorded"
    undeclared = sorted({f"{m}/{r}/{k}" for m, r, k, _ in grid.seen if declared(m, r, k) is None})
    assert undeclared == [], "fields sent but not declared in privacy/client_fields.py: " \
        + ", ".join(undeclared)
    outside = sorted({f"{m}/{r}/{k}={v!r}" for m, r, k, v in grid.seen
                      if declared(m, r, k).values and str(v) not in declared(m, r, k).values})
    assert outside == [], "values outside the declared vocabulary of privacy/client_fields.py: " \
        + ", ".join(outside)
    # a reply with no record (query.hold) is a release too: its message must have a row
    listed = {f.message for f in client_fields()}
    unlisted = sorted(grid.types - listed)
    assert unlisted == [], "replies without a row in privacy/client_fields.py: " \
        + ", ".join(unlisted)


def walk(cfg, run_flower, hold=0.0):
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.records import FlowerOptions, to_run_config

    options = FlowerOptions(hold=hold)
    grid = RecordingGrid(client_app, to_run_config(cfg, options), cfg.data.clients)
    run_flower(cfg, grid, options)
    check(grid)
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
    if cfg.privacy.secagg:
        assert {"query.keygen", "query.decrypt"} <= messages
        # under secure aggregation no payload tensor leaves a client in the clear
        assert not [k for m, r, k, _ in seen if m == "query.payload" and r == "payload"]
    if cfg.privacy.dp_train:
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

    from privfedcal.experiment import build_experiment
    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.link import FlowerRoundError, GridLink
    from privfedcal.flower.records import FlowerOptions, state_to_record, to_run_config

    for flags, refused in ((dict(dp_eps=8.0, method="ccvr"), True), (dict(), False)):
        cfg = flower_cfg(rounds=1, **flags)
        grid = LoopbackGrid(client_app, to_run_config(cfg), cfg.data.clients)
        link = GridLink(grid, cfg.data.clients, FlowerOptions(round_timeout=5))
        exp = build_experiment(cfg)
        content = RecordDict({"global": state_to_record(exp.model.state_dict())})
        if refused:
            with pytest.raises(FlowerRoundError, match="refused-by-policy"):
                link.exchange(content, [0], "evaluate", "eval")
        else:
            reply = link.exchange(content, [0], "evaluate", "eval")[0].content
            assert set(reply["metrics"]) == {"num-examples", "loss", "accuracy"}


#: text an error carries that must not leave the node: a number, a path, a private size
SECRET = "loss 3.14159 on /home/alice/data, n_k=417"


def _train_exchange(grid, cfg, clients=(0,)):
    """One train message to ``clients`` through a GridLink; the FlowerRoundError it ends in."""
    from flwr.app import ConfigRecord, RecordDict

    from privfedcal.experiment import build_experiment
    from privfedcal.flower.link import FlowerRoundError, GridLink
    from privfedcal.flower.records import FlowerOptions, state_to_record

    link = GridLink(grid, cfg.data.clients, FlowerOptions(round_timeout=5))
    content = RecordDict({"global": state_to_record(build_experiment(cfg).model.state_dict()),
                          "config": ConfigRecord({"round": 1})})
    with pytest.raises(FlowerRoundError) as info:
        link.exchange(content, list(clients), "train", "1")
    return str(info.value)


def _errors(grid):
    return [(m, k, v) for m, r, k, v in grid.seen if r == "error"]


@pytest.mark.parametrize(("make", "code"), [
    (lambda: UsageError(SECRET), "bad-config"),
    (lambda: PrivacyBudgetError(SECRET), "budget-exhausted"),
    (lambda: UploadRejected(SECRET), "upload-rejected-locally"),
    (lambda: ReleaseSkipped(SECRET), "release-skipped"),
    (lambda: Diverged(1, SECRET, client=0), "diverged"),
    (lambda: torch.OutOfMemoryError(SECRET), "out-of-memory"),
    (lambda: MemoryError(SECRET), "out-of-memory"),
    (lambda: KeyError(SECRET), "internal-error"),
], ids=["usage", "budget", "upload", "skipped", "diverged", "cuda-oom", "oom", "other"])
def test_an_error_reply_carries_its_code_only(make, code, flower_cfg, monkeypatch, caplog):
    """A handler that raises: the reply's reason is the error's code, the error's text is in
    no byte of the reply, and the node's own log holds it."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from privfedcal.flower import client_app
    from privfedcal.flower.client_app import app
    from privfedcal.flower.records import to_run_config

    def failing(*args, **kwargs):
        raise make()

    monkeypatch.setattr(client_app, "train_client", failing)
    cfg = flower_cfg(rounds=1)
    grid = RecordingGrid(app, to_run_config(cfg), cfg.data.clients)
    wire = []
    deliver = grid.client_app

    def recording(msg, context):  # the reply's bytes as they would go out
        reply = deliver(msg, context)
        wire.append(b"".join(o.deflate() for o in get_all_nested_objects(reply).values()))
        return reply

    grid.client_app = recording
    with caplog.at_level("ERROR", logger="privfedcal.flower.client"):
        message = _train_exchange(grid, cfg)
    check(grid)
    assert _errors(grid) == [("train", "code", 2), ("train", "reason", code)]
    assert wire and not any(b"3.14159" in w or b"alice" in w for w in wire)
    assert f"node {NODE_BASE}: {code}" in message and "3.14159" not in message
    assert "3.14159" in caplog.text  # the node's log has the full error


def test_unknown_message_and_bad_node_config_are_codes(flower_cfg):
    """Errors the real handlers raise: a message type without a handler, a node whose
    num-partitions differs from the run's."""
    from flwr.app import Message, RecordDict

    from privfedcal.flower.client_app import app
    from privfedcal.flower.records import to_run_config

    cfg = flower_cfg(rounds=1)
    grid = RecordingGrid(app, to_run_config(cfg), cfg.data.clients)
    grid.contexts[NODE_BASE + 1].node_config["num-partitions"] = 5
    grid.send_and_receive([
        Message(RecordDict(), dst_node_id=NODE_BASE, message_type="query.nothing"),
        Message(RecordDict(), dst_node_id=NODE_BASE + 1, message_type="query.hello")])
    check(grid)
    assert [v for m, k, v in _errors(grid) if k == "reason"] == \
        ["unknown-message", "bad-config"]


def test_an_error_reply_has_its_row(flower_cfg, monkeypatch):
    """Without the error rows of privacy/client_fields.py the walk fails on an error reply."""
    import privfedcal.privacy.client_fields as fields
    from privfedcal.flower.client_app import app
    from privfedcal.flower.records import to_run_config

    cfg = flower_cfg(rounds=1)
    grid = RecordingGrid(app, to_run_config(cfg), cfg.data.clients)
    grid.contexts[NODE_BASE].node_config["num-partitions"] = 5
    _train_exchange(grid, cfg)
    check(grid)
    monkeypatch.setattr(fields, "FIXED_FIELDS", tuple(
        f for f in fields.FIXED_FIELDS if f.record != "error"))
    with pytest.raises(AssertionError, match="not declared.*/error/code, .*/error/reason"):
        check(grid)


def test_the_walk_fails_on_an_error_text(flower_cfg, monkeypatch):
    """The check can fail: a ClientApp that sends the error's text instead of its code (as
    Flower does with an exception it catches) is caught."""
    from flwr.app import Error, Message

    from privfedcal.flower import client_app
    from privfedcal.flower.client_app import app
    from privfedcal.flower.records import to_run_config

    def failing(*args, **kwargs):
        raise RuntimeError(SECRET)

    def texting(msg, exc):
        return Message(Error(code=2, reason=f"{type(exc)}:<'{exc}'>"), reply_to=msg)

    monkeypatch.setattr(client_app, "train_client", failing)
    monkeypatch.setattr(client_app, "error_reply", texting)
    cfg = flower_cfg(rounds=1)
    grid = RecordingGrid(app, to_run_config(cfg), cfg.data.clients)
    message = _train_exchange(grid, cfg)
    assert "3.14159" not in message  # the server keeps Flower's code name, not the text
    with pytest.raises(AssertionError, match="outside the declared vocabulary.*train/error/"
                       "reason=.*3.14159"):
        check(grid)
