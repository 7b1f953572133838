"""A SuperNode keeps its own ledger in its Context.state: a server that asks it for more
releases than its noise was planned for gets an error reply, never the upload
(flower/node_ledger.py, privacy/client_ledger.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, RecordDict  # noqa: E402
from loopback import NODE_BASE  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402

from privfedcal.calibration.creff import CREFF_RELEASE  # noqa: E402
from privfedcal.errors import BudgetRefused  # noqa: E402
from privfedcal.experiment import build_simulator  # noqa: E402
from privfedcal.federation.simulator import Simulator  # noqa: E402
from privfedcal.flower.link import FlowerRoundError, GridLink  # noqa: E402
from privfedcal.flower.node_ledger import LEDGER_STATE, node_ledger, node_release  # noqa: E402
from privfedcal.flower.records import FlowerOptions, state_to_record  # noqa: E402
from privfedcal.privacy.dp_accounting import DPAccounting  # noqa: E402
from privfedcal.privacy.error_codes import ErrorCode, error_code  # noqa: E402
from privfedcal.privacy.planner import participation_counts  # noqa: E402
from privfedcal.privacy.releases import DPSGD_RELEASE  # noqa: E402
from privfedcal.privacy.stages import NoiseStage  # noqa: E402
from privfedcal.privacy.transcript import load_transcript  # noqa: E402
from privfedcal.privacy.uplink import Uplink  # noqa: E402
from privfedcal.settings.floors import PrivacyOptions

#: a CReFF run cut short (its gradient matching and re-training are not under test)
CREFF_FAST = {"features_per_class": 5, "match_steps": 2, "retrain_steps": 5}
#: what a refusal's error reply says: its code (privacy/error_codes.py)
REFUSED = BudgetRefused.code


def made(grid, client):
    kept = grid.contexts[NODE_BASE + client].state.config_records.get(LEDGER_STATE)
    return json.loads(str(kept["made"])) if kept is not None else {}


def overselection(flower_cfg, tmp_path):
    """(cfg, c, T, r): client c is selected in the most rounds T < rounds, not in round r."""
    for seed in range(20):
        cfg = flower_cfg(method="creff", clients=4, participation=0.5, rounds=4, seed=seed,
                         dp_eps=8.0, transcript=True, calibration_params=CREFF_FAST)
        counts = participation_counts(PrivacyOptions.of(cfg))
        t = max(counts.values())
        if t == cfg.training.rounds:
            continue
        sim = build_simulator(cfg.replace(out=str(tmp_path / "plan")), tmp_path / "plan")
        c = next(c for c, n in counts.items() if n == t)
        free = [r for r in range(1, cfg.training.rounds + 1) if c not in sim.select_clients(r)]
        return cfg, c, t, free[-1]
    raise AssertionError("no seed gives an over-selectable client")


def test_node_refuses_an_overselection_and_the_release_goes_on(flower_cfg, run_flower,
                                                               tmp_path, monkeypatch):
    """The server selects client c in one round more than planned and skips its own guard
    (``DPAccounting.check``): c's node answers its (T+1)-th ``query.payload`` with an error
    reply, the release goes on with the others (flower.min-replies), and c's uploads in the
    server's transcript stay within the target."""
    cfg, client, t, extra = overselection(flower_cfg, tmp_path)
    planned = Simulator.select_clients
    monkeypatch.setattr(Simulator, "select_clients", lambda self, r: sorted(
        {*planned(self, r), client}) if r == extra else planned(self, r))
    monkeypatch.setattr(DPAccounting, "check", lambda self, label, clients=None: None)
    fl, summary, grid = run_flower(cfg, options=FlowerOptions(round_timeout=30,
                                                              min_replies=1))
    (drop,) = [d for d in summary["dropped_clients"] if d["client"] == client]
    assert drop["message"] == "query.payload" and drop["group"] == f"{CREFF_RELEASE}-{extra}"
    assert drop["reason"] == REFUSED
    assert summary["skipped_releases"] == []
    uploads = [e for e in load_transcript(fl.transcript.directory)
               if e["label"] == CREFF_RELEASE and e["view"] == "plain-upload"
               and e["client"] == client]
    assert len(uploads) == t
    assert made(grid, client) == {CREFF_RELEASE: t}
    dp = fl.uplink.find(NoiseStage).dp
    acc = RDPAccountant()
    acc.history = [(dp.sigmas[CREFF_RELEASE], 1.0, len(uploads))]
    assert acc.get_epsilon(delta=dp.delta) <= cfg.privacy.dp_eps


def test_node_refuses_dp_sgd_training_past_its_planned_rounds(flower_cfg, run_flower,
                                                              monkeypatch):
    """Under --dp-train a node trains in at most the planned rounds: a further ``train``
    message gets an error reply, even from a fresh ClientApp process (the ledger lives in
    the node's Context.state, not in the process)."""
    from privfedcal.flower import client_app

    cfg = flower_cfg(method="fedavg", dp_eps=8.0, dp_train=True, rounds=1)
    fl, _, grid = run_flower(cfg)
    assert made(grid, 0) == made(grid, 1) == {DPSGD_RELEASE: 1}
    monkeypatch.setattr(client_app, "_EXPERIMENTS", {})  # as a new process per message
    link = GridLink(grid, cfg.data.clients, FlowerOptions(round_timeout=30))
    content = RecordDict({"global": state_to_record(fl.global_state),
                          "config": ConfigRecord({"round": 2})})
    with pytest.raises(FlowerRoundError) as info:
        link.exchange(content, [0], "train", "2")
    assert REFUSED in str(info.value)
    assert made(grid, 0) == {DPSGD_RELEASE: 1}


def test_a_run_without_dp_keeps_no_ledger_and_a_failed_release_is_not_counted(flower_cfg):
    """No budget, no ledger; a refusal's code is budget-exhausted; a handler that fails
    counts nothing; another run of the node starts afresh."""
    from privfedcal.experiment import build_experiment, calibrator_class
    from privfedcal.privacy.planner import build_uplink

    assert error_code(BudgetRefused("x")) == ErrorCode.BUDGET_EXHAUSTED == REFUSED
    context = Context(run_id=7, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert node_ledger(context, Uplink()) is None
    cfg = flower_cfg(method="ccvr", dp_eps=8.0)
    uplink = build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg))
    with pytest.raises(RuntimeError, match="crashed"), node_release(context, uplink,
                                                                     "ccvr-stats"):
        raise RuntimeError("crashed before uploading")
    assert LEDGER_STATE not in context.state.config_records
    with node_release(context, uplink, "ccvr-stats"):
        pass
    with pytest.raises(BudgetRefused), node_release(context, uplink, "ccvr-stats"):
        pass
    # another run of the same node (a Flower run series shares its state) starts afresh
    other = Context(run_id=8, node_id=1, node_config={}, state=context.state, run_config={})
    assert node_ledger(other, uplink).made == {}
