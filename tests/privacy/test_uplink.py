"""The protected uplink: budget guards, secure aggregation, hidden counts, bad uploads."""

from __future__ import annotations

import math

import pytest
import tenseal as ts
import torch

from privfedcal.calibration.ccvr import CCVR
from privfedcal.errors import PrivacyBudgetError, ReleaseSkipped
from privfedcal.experiment import calibrator_class
from privfedcal.privacy.accounting import PrivacyAccountant
from privfedcal.privacy.planner import DPAccounting, build_uplink
from privfedcal.privacy.secagg import ServerAggregator
from privfedcal.privacy.secagg_stage import CKKSSettings, EncryptStage, unpad
from privfedcal.privacy.stages import ClearWire, NoiseStage
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.uplink import Uplink


def stats_payload(counts, d=3, seed=0):
    """A CCVR-shaped upload: count (C,), sum (C, d), outer (C, d, d) from random features."""
    g = torch.Generator().manual_seed(seed)
    c = len(counts)
    out = {"count": torch.tensor(counts, dtype=torch.float64),
           "sum": torch.zeros(c, d, dtype=torch.float64),
           "outer": torch.zeros(c, d, d, dtype=torch.float64)}
    for k, n in enumerate(counts):
        z = torch.randn(int(n), d, generator=g, dtype=torch.float64)
        out["sum"][k] = z.sum(0)
        out["outer"][k] = z.T @ z
    return out


def ckks_settings(clients=8, n=100, clip=10.0, dp=None):
    """CKKS settings for ``clients`` clients (no cohorts). The sums these tests make hold at
    most 6 clients, so with 8 clients the run's public totals single out none of the others
    and the whole-run check before each decryption passes."""
    bounds = {"count": n, "holders": clients, "sum": clip * n, "outer": clip * clip * n,
              "grad": n}
    return CKKSSettings(bounds=bounds, dp=dp, clients=clients)


def dp_accounting(sigma=1.0, target=100.0, label="ccvr-stats", distributed=False, planned=4,
             releases=1000):
    """``releases``: the planned releases per client (each client's ledger refuses more)."""
    return DPAccounting(target=target, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                   sigmas={label: sigma}, rates={label: 1.0}, clip=10.0, grad_clip=1.0,
                   distributed=distributed, covers_updates=False,
                   planned=[{"name": label, "sample_rate": 1.0, "steps": releases}],
                   planned_clients={label: planned},
                   specs={r.label: r for r in CCVR.releases})  # the planner passes them


def opened(stage, example):
    """An opened secure release: its ``Sealing`` (what clients get) and the server's
    aggregator under the public context."""
    up = Uplink([EncryptStage(stage)])
    rel = up.release("ccvr-stats", 1, [0, 1], [0, 1], example, Transcript(None))
    up.open(rel)
    sealing = rel.state["sealing"]
    return sealing, ServerAggregator(sealing.public, sealing.layout, n_threads=1)


def plain_sum(uploads):
    return {k: sum(p[k] for _, p in uploads) for k in uploads[0][1]}


def test_secure_sum_matches_plaintext_and_server_sees_no_upload(tmp_path):
    uploads = [(k, stats_payload([3, 0, 5], seed=k)) for k in range(3)]
    tr = Transcript(tmp_path / "t")
    up = Uplink([EncryptStage(ckks_settings())])
    total = up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=tr)
    ref = plain_sum(uploads)
    for k in ref:
        # the key holder's decryption flooding (privacy/secagg.py) is ~1e-3 here
        assert torch.allclose(total[k], ref[k], rtol=1e-4, atol=1e-2), k
    views = [e["view"] for e in tr.entries]
    assert views.count("ciphertext") == 3 and views.count("aggregate") == 1
    assert "plain-upload" not in views


def test_keys_are_fresh_for_every_release_and_used_for_one_decryption():
    """Two releases of one uplink get two key pairs (the key holder's key ids differ), and a
    release's secret key leaves the key holder once its one sum is decrypted."""
    from privfedcal.privacy.secagg_stage import LocalKeys

    made, kept = [], []

    class SpyKeys(LocalKeys):
        def keygen(self, rel, params):
            public = super().keygen(rel, params)
            made.append(rel.state["key-holder"].key_id)
            return public

        def decrypt(self, ciphertexts, layout, rel, finish, contributors):
            out = super().decrypt(ciphertexts, layout, rel, finish, contributors)
            kept.append("key-holder" in rel.state)
            return out

    up = Uplink([EncryptStage(ckks_settings(), keys=SpyKeys())])
    for r in (1, 2):
        uploads = [(k, stats_payload([3, 0, 5], seed=k)) for k in range(3)]
        up.aggregate(uploads, round_=r, label="ccvr-stats", transcript=Transcript(None))
    assert len(made) == 2 and made[0] != made[1]
    assert kept == [False, False]


def test_server_context_is_public_and_cannot_decrypt():
    sealing, server = opened(ckks_settings(), stats_payload([2, 2]))
    assert not server.context.is_private()
    server.add(unpad(sealing.seal(stats_payload([2, 2], seed=1))))
    server.add(unpad(sealing.seal(stats_payload([1, 3], seed=2))))
    enc = ts.ckks_vector_from(server.context, server.result()[0])
    with pytest.raises(ValueError):
        enc.decrypt()


def test_hidden_counts_server_view_independent_of_class_sets(tmp_path):
    """Swapping which client holds which classes (same totals) changes nothing recorded
    except the CKKS noise of the aggregate."""
    a = [(0, stats_payload([4, 0], seed=1)), (1, stats_payload([0, 4], seed=2))]
    b = [(0, a[1][1]), (1, a[0][1])]
    views = []
    for uploads in (a, b):
        tr = Transcript(None)
        total = Uplink([EncryptStage(ckks_settings())]).aggregate(uploads, round_=1, label="ccvr-stats",
                                                        transcript=tr)
        views.append(([(e["view"], e["client"], e.get("bytes")) for e in tr.entries], total))
    assert views[0][0] == views[1][0]
    for k in views[0][1]:
        assert torch.allclose(views[0][1][k], views[1][1][k], atol=1e-2)


def test_malformed_uploads_are_rejected_and_round_goes_on():
    good = [(k, stats_payload([2, 3], seed=k)) for k in range(3)]
    bad_shape = (7, stats_payload([2, 3, 1]))
    bad_nan = (8, {**stats_payload([2, 3]), "sum": torch.full((2, 3), math.nan,
                                                              dtype=torch.float64)})
    up = Uplink()
    total = up.aggregate([*good, bad_shape, bad_nan], round_=1, label="x",
                         transcript=Transcript(None))
    assert {r["client"] for r in up.rejected} == {7, 8}
    assert torch.allclose(total["count"], plain_sum(good)["count"])


def test_foreign_and_tampered_ciphertexts_are_rejected():
    from privfedcal.errors import UploadRejected

    stage = ckks_settings()
    sealing, server = opened(stage, stats_payload([2, 2]))
    other, _ = opened(stage, stats_payload([2, 2]))  # another key holder's context
    with pytest.raises(UploadRejected):
        server.add(unpad(other.seal(stats_payload([2, 2]))))
    data = bytearray(unpad(sealing.seal(stats_payload([2, 2]))))
    with pytest.raises(UploadRejected):
        server.add(bytes(data[: len(data) // 2]))  # truncated
    data[len(data) // 3] ^= 0xFF
    with pytest.raises(UploadRejected):
        server.add(bytes(data))  # tampered
    assert server.count == 0


def test_too_few_valid_clients_skips_the_release():
    up = Uplink([EncryptStage(ckks_settings())])
    uploads = [(0, stats_payload([2, 2])), (1, stats_payload([2, 2, 2]))]
    with pytest.raises(ReleaseSkipped):
        up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=Transcript(None))
    assert up.skipped and up.rejected


def test_budget_guard_stops_before_an_unplanned_release():
    dp = dp_accounting(sigma=1.0, target=5.0)
    up = Uplink([NoiseStage(dp), ClearWire()])
    uploads = [(k, stats_payload([2, 2], seed=k)) for k in range(2)]
    released = 0
    with pytest.raises(PrivacyBudgetError):
        for _ in range(100):
            up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=Transcript(None))
            released += 1
    assert released >= 1
    assert dp.accountant.epsilon() <= 5.0


def _distributed_noise_variance(n_good, planned=4, reps=20, d=8):
    """Normalised variance of the released sum's noise, n_good of ``planned`` uploads valid."""
    dp = dp_accounting(sigma=0.5, target=1e9, distributed=True, planned=planned)
    stds = dp.stds(["count", "sum", "outer"], "ccvr-stats")
    iu = torch.triu_indices(d, d)
    samples = []
    for _ in range(reps):
        up = Uplink([NoiseStage(dp), EncryptStage(ckks_settings(dp=dp))])
        good = [(k, stats_payload([3, 3], d=d, seed=k)) for k in range(n_good)]
        bad = [(k, stats_payload([3, 3, 3], d=d)) for k in range(n_good, planned)]
        total = up.aggregate([*good, *bad], round_=1, label="ccvr-stats",
                             transcript=Transcript(None))
        ref = plain_sum(good)
        samples.append(((total["sum"] - ref["sum"]) / stds["sum"]).flatten())
        outer = (total["outer"] - ref["outer"]) / stds["outer"]
        samples.append(outer[:, iu[0], iu[1]].flatten())
    return float(torch.cat(samples).var())


def test_distributed_noise_shares_and_top_up():
    """Each of n = 4 planned clients adds 1/(n-1) of the variance, so the sum carries
    n/(n-1) = 4/3 of it (the full variance even against a participant that knows its own
    share). One upload rejected: the key holder tops up the missing 1/3, so the release still
    carries 4/3 (without the top-up it would be 1). 1760 normal draws per case: SE ~ 0.05."""
    assert 1.17 < _distributed_noise_variance(3) < 1.5
    assert 1.17 < _distributed_noise_variance(4) < 1.5


def test_distributed_share_comes_from_the_config_not_the_server():
    dp = dp_accounting(distributed=True, planned=5)
    assert dp.share("ccvr-stats") == pytest.approx(1 / 4)
    assert dp.topup_share("ccvr-stats", arrived=5) == 0
    assert dp.topup_share("ccvr-stats", arrived=3) == pytest.approx(2 / 4)
    assert dp_accounting(distributed=False).share("ccvr-stats") == 1.0
    assert dp_accounting(distributed=True, planned=2).share("ccvr-stats") == 1.0


def test_refuses_to_start_when_budget_cannot_be_met(tiny_cfg):
    from privfedcal.experiment import build_experiment

    cfg = tiny_cfg(method="creff", dp_eps=1e-6, rounds=50)
    exp = build_experiment(cfg)
    with pytest.raises(PrivacyBudgetError):
        build_uplink(cfg, exp, calibrator_class(cfg))


def test_lazy_uploads_are_summed_one_at_a_time():
    """With ``asked``, uploads computed on demand are passed on and dropped one by one: when
    client k's payload is computed, every one before k - 2 but the first (the release's
    example) is freed (k - 2 is the last one summed when k - 1 was rejected); the sum and
    the rejections equal those of the list."""
    import weakref

    payloads = {k: stats_payload([2, 3], seed=k) for k in range(6)}
    payloads[4] = {**payloads[4], "sum": torch.full((2, 3), math.nan, dtype=torch.float64)}
    alive: list[weakref.ref] = []
    held_at: dict[int, list[int]] = {}

    def lazy():
        for k, p in payloads.items():
            held_at[k] = [i for i, r in enumerate(alive) if r() is not None]
            fresh = {n: v.clone() for n, v in p.items()}
            alive.append(weakref.ref(fresh["outer"]))
            yield k, fresh

    up = Uplink()
    total = up.aggregate(lazy(), round_=1, label="x", transcript=Transcript(None),
                         asked=list(payloads))
    for k, held in held_at.items():
        assert set(held) <= {0, k - 2, k - 1}, (k, held)
    listed = Uplink()
    expected = listed.aggregate(list(payloads.items()), round_=1, label="x",
                                transcript=Transcript(None))
    for name in expected:
        assert torch.allclose(total[name], expected[name])
    assert [r["client"] for r in up.rejected] == [r["client"] for r in listed.rejected] == [4]


def test_secure_sum_adds_each_cohort_once_it_is_complete():
    """Uploads sent cohort by cohort are added as each cohort completes (its ciphertexts
    recorded before the next cohort's first upload is computed), so the wire holds one
    cohort at a time; an incomplete cohort is left out; the sum is that of the rest."""
    import dataclasses

    stage = dataclasses.replace(ckks_settings(clients=6), cohorts=((0, 4), (1, 2), (3, 5)))
    payloads = {k: stats_payload([2, 3], seed=k) for k in (0, 4, 1, 2, 3)}  # 5 never sent
    tr = Transcript(None)
    summed_before: dict[int, set[int]] = {}

    def lazy():
        for k, p in payloads.items():
            summed_before[k] = {e["client"] for e in tr.entries if e["view"] == "ciphertext"}
            yield k, p

    up = Uplink([EncryptStage(stage)])
    total = up.aggregate(lazy(), round_=1, label="ccvr-stats", transcript=tr,
                         asked=list(range(6)))
    assert summed_before[1] == {0, 4} and summed_before[3] == {0, 4, 1, 2}
    assert [r["client"] for r in up.rejected] == [3]
    expected = plain_sum([(k, payloads[k]) for k in (0, 4, 1, 2)])
    assert torch.allclose(total["count"], expected["count"], atol=1e-2)
    assert torch.allclose(total["sum"], expected["sum"], atol=1e-2)
