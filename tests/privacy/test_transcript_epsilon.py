"""Each client's epsilon recomputed from the server's record and the public plan, by opacus."""

from __future__ import annotations

import pytest
import torch
from opacus.accountants import RDPAccountant

from privfedcal.privacy.quantile import QUANTILE_RELEASE as CLIP
from privfedcal.privacy.releases import DPSGD_RELEASE as DPSGD
from privfedcal.privacy.releases import USER_DP_RELEASE as USER_DP
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.transcript_epsilon import (
    PublicPlan,
    file_loader,
    held_releases,
    transcript_epsilons,
)

PLAN = PublicPlan(sigmas={"ccvr-stats": 2.0, DPSGD: 1.1, USER_DP: 3.0,
                          f"{CLIP}/1": 5.0, f"{CLIP}/2": 6.0},
                  rates={"ccvr-stats": 1.0, DPSGD: 0.05, USER_DP: 1.0,
                         f"{CLIP}/1": 1.0, f"{CLIP}/2": 1.0},
                  steps={DPSGD: 40}, delta=1e-5, accountant="rdp")


def opacus_epsilon(*history):
    """opacus' RDPAccountant on ``history`` ((z, q, steps) per entry), as a user would."""
    acc = RDPAccountant()
    acc.history = list(history)
    return acc.get_epsilon(delta=1e-5)


def upload(tr, round_, client, value, label="ccvr-stats"):
    tr.record(round_=round_, label=label, view="plain-upload", client=client,
              tensors={"sum": torch.tensor([float(value)])}, bytes=4)


def test_a_release_received_twice_with_one_value_is_charged_once(tmp_path):
    """Client 0: rounds 1 and 2, round 2 received again with the same value (a redone
    round re-sending its journaled upload); client 1: round 1 received twice with two
    values (a redone round that drew fresh noise): two releases, as opacus composes them."""
    tr = Transcript(tmp_path)
    upload(tr, 1, 0, 1.0)
    upload(tr, 2, 0, 2.0)
    upload(tr, 1, 1, 5.0)
    tr.attempt = 1
    upload(tr, 2, 0, 2.0)
    upload(tr, 1, 1, 6.0)
    tr.flush()
    out = transcript_epsilons(tr.entries, PLAN, file_loader(tmp_path))
    assert held_releases(tr.entries, PLAN, file_loader(tmp_path)) == {
        0: {"ccvr-stats": 2}, 1: {"ccvr-stats": 2}}
    assert out["per_client"]["0"] == pytest.approx(opacus_epsilon((2.0, 1.0, 2)), rel=1e-9)
    assert out["epsilon"] == out["per_client"]["1"] == out["per_client"]["0"]
    assert out["releases"] == 4 and out["repeated"] == 1
    # without the files nothing can be compared: every attempt counts
    assert held_releases(tr.entries, PLAN)[0] == {"ccvr-stats": 3}


def test_secure_sums_charge_their_contributors_once_per_distinct_sum(tmp_path):
    tr = Transcript(tmp_path)

    def secure(round_, clients, value, aggregate=True):
        for c in clients:
            tr.record(round_=round_, label="ccvr-stats", view="ciphertext", client=c,
                      bytes=100)
        if aggregate:
            tr.record(round_=round_, label="ccvr-stats", view="aggregate", client=None,
                      tensors={"sum": torch.tensor([value])}, clients=len(clients))

    secure(1, [0, 1], 3.0)
    tr.attempt = 1
    secure(1, [0, 1], 3.0)  # the key holder re-released its journaled sum
    secure(2, [0, 1], 4.0, aggregate=False)  # stopped before the sum: nothing released
    tr.attempt = 2
    secure(2, [0, 1], 4.5)
    secure(2, [2, 3], 9.0)
    tr.flush()
    held = held_releases(tr.entries, PLAN, file_loader(tmp_path))
    assert held == {0: {"ccvr-stats": 2}, 1: {"ccvr-stats": 2}, 2: {"ccvr-stats": 1},
                    3: {"ccvr-stats": 1}}


def test_model_updates_are_charged_to_dp_sgd_and_dp_fedavg_by_the_plan(tmp_path):
    tr = Transcript(tmp_path)
    for r in (1, 2):
        upload(tr, r, 7, r, label="model-update")
    tr.flush()
    out = transcript_epsilons(tr.entries, PLAN, file_loader(tmp_path))
    assert out["per_client"]["7"] == pytest.approx(
        opacus_epsilon((1.1, 0.05, 80), (3.0, 1.0, 2)), rel=1e-9)
    dp_sgd_only = PublicPlan({DPSGD: 1.1}, {DPSGD: 0.05}, {DPSGD: 40}, 1e-5, "rdp")
    assert held_releases(tr.entries, dp_sgd_only) == {7: {DPSGD: 2}}
    no_dp = PublicPlan({}, {}, {}, 1e-5, "rdp")
    assert transcript_epsilons(tr.entries, no_dp)["epsilon"] == 0.0


def test_the_clip_searchs_stages_are_told_apart_by_their_tensors(tmp_path):
    tr = Transcript(tmp_path)
    for stage in (1, 2):
        tr.record(round_=0, label=CLIP, view="plain-upload", client=4,
                  tensors={f"stage{stage}": torch.ones(3)})
    tr.flush()
    assert held_releases(tr.entries, PLAN, file_loader(tmp_path)) == {
        4: {f"{CLIP}/1": 1, f"{CLIP}/2": 1}}
    # without the tensors each entry may be either stage: both are charged, once per
    # attempt
    assert held_releases(tr.entries, PLAN) == {4: {f"{CLIP}/1": 1, f"{CLIP}/2": 1}}


def test_the_plan_of_a_run_is_its_planned_noise_not_its_spend(tiny_cfg, tmp_path):
    from privfedcal.experiment import build_simulator

    sim = build_simulator(tiny_cfg(method="ccvr", dp_eps=8.0, transcript=True), tmp_path)
    summary = sim.run()
    plan = PublicPlan.of(sim.uplink.stages[1].dp)
    assert dict(plan.sigmas) == summary["privacy"]["noise_multipliers"]
    recomputed = summary["privacy"]["from_transcript"]
    assert recomputed["epsilon"] == pytest.approx(summary["privacy"]["epsilon_spent"])
    assert recomputed["repeated"] == 0 and recomputed["releases"] == 4
