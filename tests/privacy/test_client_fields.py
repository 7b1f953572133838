"""The simulator's server view holds only declared client fields (privacy/client_fields.py).

Runs with every protection on write their transcript (the server's view); every recorded
tensor and every entry key that comes from a client must map to a declared field (the fixed
``FIXED_FIELDS`` and the declared releases' payload keys, ``attacks/fields_table.py``). The Flower side walks the real wire messages
(tests/flower/test_wire_fields.py). The table in docs/threat-model.md is the code's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from privfedcal.attacks.fields_table import client_fields, declared, markdown_table
from privfedcal.experiment import build_simulator
from privfedcal.privacy import client_fields as fields
from privfedcal.privacy.client_fields import (
    TRANSCRIPT_ENTRY_KEYS,
    payload_fields,
    transcript_field,
)
from privfedcal.privacy.releases import ReleaseSpec
from privfedcal.privacy.transcript import load_transcript

#: entry keys the server writes itself: its own bookkeeping (``file``, ``key``: where the
#: entry's tensors are) or the public config
BOOKKEEPING = {"round", "label", "view", "client", "file", "key", "tensors", "participants",
               "clients", "local_epochs", "batch_size", "lr"}


def undeclared_fields(entries: list[dict]) -> list[str]:
    bad = []
    for e in entries:
        where = f"{e['label']}/{e['view']}"
        if e["view"] == "model-state":  # what the server itself sent
            continue
        for key in set(e) - BOOKKEEPING:
            if key == "weight_sum" and e["view"] == "aggregate":
                continue  # the decrypted weight slot of the aggregate
            if key not in TRANSCRIPT_ENTRY_KEYS:
                bad.append(f"{where}: entry key {key!r}")
        tensors = e.get("tensors") or {}
        if not tensors:
            continue
        field = transcript_field(e["label"], e["view"])
        if field is None:
            bad.append(f"{where}: tensors of an undeclared record")
            continue
        message, record, *star = field.split("/")
        bad += [f"{where}: tensor {k!r}" for k in tensors
                if declared(message, record, star[0] if star else k) is None]
    return bad


@pytest.mark.parametrize("flags", [
    dict(method="ccvr", dp_eps=8.0, secagg=True, hide_counts=True, dp_train=True),
    dict(method="creff", dp_eps=8.0, secagg=True, hide_counts=True),
    dict(method="ccvr", secagg=True, secagg_updates=True),
    dict(method="creff", dp_eps=8.0),
    dict(method="ccvr"),
], ids=["ccvr-all", "creff-secagg", "secagg-updates", "creff-dp-plain", "ccvr-plain"])
def test_server_view_holds_only_declared_fields(flags, tmp_path, tiny_cfg):
    cfg = tiny_cfg(rounds=1, clients=3, transcript=True, out=str(tmp_path / "run"), **flags)
    sim = build_simulator(cfg, tmp_path / "run")
    sim.run()
    entries = load_transcript(Path(sim.transcript.directory))
    assert [e for e in entries if e["view"] != "model-state"]
    assert undeclared_fields(entries) == []


def test_the_walk_catches_an_undeclared_tensor_and_entry_key():
    entries = [{"round": 1, "label": "ccvr-stats", "view": "plain-upload", "client": 0,
                "tensors": {"sum": 0, "labels": 0}, "loss": 0.3}]
    assert undeclared_fields(entries) == ["ccvr-stats/plain-upload: entry key 'loss'",
                                          "ccvr-stats/plain-upload: tensor 'labels'"]


def test_every_field_is_named_once_and_the_doc_prints_the_table():
    names = [f.name for f in client_fields()]
    assert len(names) == len(set(names))
    doc = (Path(__file__).parents[2] / "docs" / "threat-model.md").read_text()
    assert markdown_table() in doc, "docs/threat-model.md must hold markdown_table() verbatim"


def test_payload_rows_come_from_the_declared_releases():
    """A release's payload keys are declared by its ReleaseSpec alone: a key shared by two
    releases is one row naming both; each key is charged, with its sensitivity; a release
    that does not say what a key holds cannot be tabled; without releases no payload key is
    declared."""
    a = ReleaseSpec("probe-a", {"s": "R", "n": "1"}, {"s": "R*N", "n": "N"}, "all",
                    holds={"s": "sums (C, d)", "n": "counts (C,)"})
    b = ReleaseSpec("probe-b", {"n": "1"}, {"n": "N"}, "selected",
                    holds={"n": "counts (C,), sometimes"})
    s, n = payload_fields([a, b], {"probe-a": ["stats"]})
    assert [f.name for f in (s, n)] == ["query.payload/payload/s", "query.payload/payload/n"]
    assert n.holds == "probe-a: counts (C,); probe-b: counts (C,), sometimes"
    assert n.flag == ("probe-a (after training, every client) / probe-b (each round, its "
                      "selected clients) without --secagg")
    assert s.protection == "DP with --dp-eps (L2 sensitivity R)"
    assert n.protection == "DP with --dp-eps (L2 sensitivity probe-a 1, probe-b 1)"
    assert s.budget.startswith("charged with --dp-eps") and "`attack invert --stats`" in s.budget
    assert "invert" not in payload_fields([b])[0].budget
    assert fields.declared("query.payload", "payload", "s", [a], {"probe-a": ["stats"]}) == s
    assert fields.declared("query.payload", "payload", "s", [b]) is None
    assert fields.declared("query.payload", "payload", "s", []) is None
    with pytest.raises(ValueError, match="do not say what payload key 's' holds"):
        payload_fields([ReleaseSpec("probe-c", {"s": "R"}, {"s": "R*N"})])
    with pytest.raises(ValueError, match="undeclared payload key"):
        ReleaseSpec("probe-d", {"s": "R"}, {"s": "R*N"}, holds={"t": "?"})

