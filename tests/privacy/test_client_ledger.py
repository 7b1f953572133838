"""Each client keeps its own ledger: a server that selects it more often than planned gets a
refusal, never more releases than its noise was calibrated for (privacy/client_ledger.py)."""

from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from privfedcal.calibration.creff import CREFF_RELEASE
from privfedcal.errors import BudgetRefused, PrivacyBudgetError, UsageError
from privfedcal.experiment import build_experiment, build_simulator, calibrator_class
from privfedcal.federation.checkpoint import load_checkpoint, save_checkpoint
from privfedcal.privacy.client_ledger import ClientLedger
from privfedcal.privacy.dp_accounting import DPAccounting
from privfedcal.privacy.planner import build_uplink, participation_counts
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.stages import NoiseStage
from privfedcal.privacy.transcript import load_transcript
from privfedcal.settings.floors import PrivacyOptions

#: a CReFF run cut short (its gradient matching and re-training are not under test)
CREFF_FAST = {"features_per_class": 5, "match_steps": 2, "retrain_steps": 5}


def opacus_eps(z, q, steps, delta):
    acc = RDPAccountant()
    acc.history = [(z, q, steps)]
    return acc.get_epsilon(delta=delta)


def planned_dp(cfg):
    return build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg)).find(NoiseStage).dp


def test_limits_are_the_counts_the_noise_was_planned_for(tiny_cfg):
    cfg = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=6, dp_eps=8.0,
                   dp_train=True)
    dp = planned_dp(cfg)
    ledger = ClientLedger.planned(dp)
    # CReFF: the most rounds any client is selected in; DP-SGD: every round (its plan)
    assert ledger.limits == {CREFF_RELEASE: max(participation_counts(PrivacyOptions.of(cfg)).values()),
                             DPSGD_RELEASE: cfg.training.rounds}
    ccvr = ClientLedger.planned(planned_dp(tiny_cfg(method="ccvr", dp_eps=8.0)))
    assert ccvr.limits == {"ccvr-stats": 1}  # one-shot statistics


def test_ledger_refuses_past_the_plan_and_its_epsilon_stays_within_the_target(tiny_cfg):
    cfg = tiny_cfg(method="creff", clients=10, participation=0.4, rounds=6, dp_eps=8.0)
    dp = planned_dp(cfg)
    ledger = dp.ledger(3)
    limit = ledger.limits[CREFF_RELEASE]
    for _ in range(limit):
        ledger.record(CREFF_RELEASE)
    with pytest.raises(BudgetRefused, match=f"made {limit} 'creff-grad'"):
        ledger.record(CREFF_RELEASE)
    with pytest.raises(BudgetRefused):
        ledger.record("never-planned")
    assert ledger.made == {CREFF_RELEASE: limit}
    assert BudgetRefused.code == "budget-exhausted"
    assert isinstance(BudgetRefused("x"), PrivacyBudgetError)  # the CLI's budget exit
    z = dp.sigmas[CREFF_RELEASE]
    assert ledger.epsilon(dp) == pytest.approx(opacus_eps(z, 1.0, limit, dp.delta))
    assert ledger.epsilon(dp) <= cfg.privacy.dp_eps < opacus_eps(z, 1.0, limit + 1, dp.delta)


def test_admit_counts_for_all_clients_or_none(tiny_cfg):
    dp = planned_dp(tiny_cfg(method="ccvr", dp_eps=8.0))
    dp.admit("ccvr-stats", [0])
    with pytest.raises(BudgetRefused):
        dp.admit("ccvr-stats", [1, 0])  # client 0 has made its one release
    assert 1 not in dp.ledgers or dp.ledgers[1].made == {}


def test_ledgers_are_part_of_the_checkpointed_state(tiny_cfg, tmp_path):
    cfg = tiny_cfg(method="ccvr", dp_eps=8.0)
    up = build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg))
    up.find(NoiseStage).dp.admit("ccvr-stats", [2])
    save_checkpoint(tmp_path / "ck", {"uplink": up.state_dict()})
    fresh = build_uplink(cfg, build_experiment(cfg), calibrator_class(cfg))
    fresh.load_state_dict(load_checkpoint(tmp_path / "ck", "cpu")["uplink"])
    dp = fresh.find(NoiseStage).dp
    assert dp.ledgers[2].made == {"ccvr-stats": 1}
    with pytest.raises(BudgetRefused):
        dp.admit("ccvr-stats", [2])
    with pytest.raises(UsageError):
        dp.ledger(5).load_state_dict({"made": {"ccvr-stats": -1}})


def overselection(tiny_cfg, tmp_path):
    """A CReFF run with DP, a client c selected in the most rounds T < rounds, a round r it
    is not planned in, and a resume point k < r before which c has made a release:
    (cfg, c, T, r, k)."""
    for seed in range(20):
        cfg = tiny_cfg(method="creff", clients=4, participation=0.5, rounds=4, seed=seed,
                       dp_eps=8.0, transcript=True, calibration_params=CREFF_FAST)
        counts = participation_counts(PrivacyOptions.of(cfg))
        t = max(counts.values())
        if t == cfg.training.rounds:
            continue
        sim = build_simulator(cfg.replace(out=str(tmp_path / "plan")), tmp_path / "plan")
        for c in (c for c, n in counts.items() if n == t):
            rounds = [r for r in range(1, cfg.training.rounds + 1) if c in sim.select_clients(r)]
            for r in range(2, cfg.training.rounds + 1):
                if r not in rounds and min(rounds) < r:
                    return cfg, c, t, r, r - 1
    raise AssertionError("no seed gives an over-selectable client")


class Stop(Exception):
    pass


@pytest.mark.parametrize("resume", [False, True], ids=["straight", "resumed"])
def test_simulated_client_refuses_an_overselection(tiny_cfg, tmp_path, monkeypatch, resume):
    """The server selects client c in one more round than planned and skips its own guard
    (``DPAccounting.check``): c's ledger refuses its (T+1)-th release, the release goes on with
    the other client, and c's uploads (the server's transcript) stay within the target;
    resumed from a checkpoint in between, the ledger survives."""
    cfg, client, t, extra, stop_after = overselection(tiny_cfg, tmp_path)
    monkeypatch.setattr(DPAccounting, "check", lambda self, label, clients=None: None)
    out = tmp_path / "run"

    def start():
        sim = build_simulator(cfg.replace(out=str(out)), out)
        planned = sim.select_clients
        sim.select_clients = lambda r: sorted({*planned(r), client}) if r == extra \
            else planned(r)
        return sim

    sim = start()
    if resume:
        def stop(record):
            if record["round"] == stop_after:
                raise Stop
        with pytest.raises(Stop):
            sim.run(progress=stop)
        sim = start()
        sim.restore()
        assert sim.start_round == stop_after + 1
    summary = sim.run()
    uploads = [e for e in load_transcript(sim.transcript.directory)
               if e["label"] == CREFF_RELEASE and e["view"] == "plain-upload"
               and e["client"] == client]
    assert len(uploads) == t
    refused = [r for r in summary["rejected_uploads"] if r["client"] == client]
    assert len(refused) == 1 and refused[0]["reason"] == "refused-by-client"
    assert summary["skipped_releases"] == []  # the others' release went on
    dp = sim.uplink.find(NoiseStage).dp
    assert dp.ledgers[client].made == {CREFF_RELEASE: t}
    z = dp.sigmas[CREFF_RELEASE]
    assert opacus_eps(z, 1.0, len(uploads), dp.delta) <= cfg.privacy.dp_eps
    assert dp.ledgers[client].epsilon(dp) <= cfg.privacy.dp_eps
