"""A SuperNode's own ledger of its DP releases, kept in its ``Context.state`` for the run.

Flower 1.41 runs a ClientApp process per message; what lasts between them on a node is the
``Context.state`` (a ``RecordDict``) the SuperNode keeps for the run and hands to each
process. The node's ledger (privacy/client_ledger.py: releases made per label) is stored
there as a ConfigRecord with the run's id; its limits come from the node's own noise plan
(the protection plan of the node's run config), never from the server's message. A release past
them raises ``BudgetRefused`` in the handler before anything is computed: the server gets an
error reply (code ``budget-exhausted``) and no upload.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flwr.app import ConfigRecord, Context

from privfedcal.flower.records import as_int
from privfedcal.privacy.client_ledger import ClientLedger
from privfedcal.privacy.stages import NoiseStage

LEDGER_STATE = "privfedcal.ledger"


def node_ledger(context: Context, uplink: Any) -> ClientLedger | None:
    """This node's ledger for the run (None where the run has no DP budget)."""
    noise = uplink.find(NoiseStage)
    if noise is None:
        return None
    ledger = ClientLedger.planned(noise.dp)
    kept = context.state.config_records.get(LEDGER_STATE)
    if kept is not None and as_int(kept["run-id"]) == int(context.run_id):
        ledger.load_state_dict({"made": json.loads(str(kept["made"]))})
    return ledger


def save_ledger(context: Context, ledger: ClientLedger) -> None:
    context.state[LEDGER_STATE] = ConfigRecord({"run-id": int(context.run_id),
                                                "made": json.dumps(ledger.made)})


@contextmanager
def node_release(context: Context, uplink: Any, label: str) -> Iterator[None]:
    """Around a handler's release of ``label``: refused before it runs if it would pass the
    node's planned count; counted in ``context.state`` once it has run (a handler that
    fails sends nothing and is not counted)."""
    ledger = node_ledger(context, uplink)
    if ledger is not None:
        ledger.check(label)
    yield
    if ledger is not None:
        ledger.record(label)
        save_ledger(context, ledger)


__all__ = ["LEDGER_STATE", "node_ledger", "node_release", "save_ledger"]
