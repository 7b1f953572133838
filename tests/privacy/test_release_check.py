"""The check before a secure sum leaves the key holder (privacy/secagg_stage.py,
cohorts.release_isolates): on hand-built participation rows, through the real CKKS wire, and
the key holder's own rule on the contributor list (cohorts.whole_cohorts)."""

from __future__ import annotations

import pytest
import torch

from privfedcal.errors import ReleaseSkipped, UploadRejected
from privfedcal.privacy.cohorts import release_isolates
from privfedcal.privacy.secagg import ServerAggregator
from privfedcal.privacy.secagg_stage import (
    WITHHELD,
    CKKSSettings,
    EncryptStage,
    LocalKeys,
    check_contributors,
    unpad,
)
from privfedcal.privacy.transcript import Transcript, secure_participants
from privfedcal.privacy.uplink import Uplink

COHORTS = ((0, 1, 2), (3, 4, 5))


def test_pre_release_check_on_hand_built_rows():
    """Six clients, m = 2, the key holder client 0 knows its own value, class totals public.
    Round 1 summed everyone. Round 2's sum over {0, 1, 2, 3, 5} (client 4 lost, its cohort
    counted "as far as asked") is round 1's less client 4's value: isolated. The whole
    cohort (0, 1, 2) alone is not (1 and 2 stay together)."""
    everyone = [list(range(6))]
    found = release_isolates(everyone, [0, 1, 2, 3, 5], 6, 2, known=(0,))
    assert found is not None and found.group == (4,) and found.exact
    assert release_isolates(everyone, [0, 1, 2], 6, 2, known=(0,)) is None
    # each sum alone holds >= m clients; their difference does not
    assert release_isolates([[0, 1, 2, 3]], [0, 1, 2], 8, 2).group == (3,)
    assert release_isolates([], [0, 1, 2, 3], 8, 2) is None
    # m = 3: a pair singled out is a group below m
    assert release_isolates([[0, 1, 2, 3, 4]], [0, 1, 2], 8, 3).group == (3, 4)
    assert release_isolates([[0, 1, 2, 3, 4]], [0, 1, 2], 8, 2) is None
    # the key holder's own value removed: {1} = {0, 1} less what client 0 knows
    assert release_isolates([], [0, 1], 8, 2, known=(0,)).group == (1,)
    assert release_isolates([], [0, 1], 8, 2) is None


def _payload(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"count": torch.randint(0, 9, (4,), generator=g).double(),
            "sum": torch.randn(4, 3, generator=g, dtype=torch.float64)}


class CountingKeys(LocalKeys):
    """The in-process key holder, counting its decryptions."""

    decrypted: int = 0

    def decrypt(self, ciphertexts, layout, rel, finish, contributors):
        self.decrypted += 1
        return super().decrypt(ciphertexts, layout, rel, finish, contributors)


def _uplink(cohorts=None, clients=6) -> tuple[Uplink, CountingKeys]:
    keys = CountingKeys()
    settings = CKKSSettings(bounds={"count": 100.0, "sum": 100.0}, dp=None, clients=clients,
                            cohorts=cohorts)
    return Uplink([EncryptStage(settings, keys=keys)]), keys


def test_a_sum_that_would_isolate_is_withheld_and_the_run_goes_on():
    """No cohorts (the rule switched off), 6 clients, m = 2: {0, 1, 2, 3}, then {0, 1, 2}
    (their difference is client 3's upload: withheld, never decrypted, recorded by its code
    with public counts), then {0, 1, 4, 5} (released: nothing finer than a pair)."""
    up, keys = _uplink()
    tr = Transcript(None)
    for round_, clients in ((1, [0, 1, 2, 3]), (2, [0, 1, 2]), (3, [0, 1, 4, 5])):
        uploads = [(c, _payload(10 * round_ + c)) for c in clients]
        try:
            up.aggregate(uploads, round_=round_, label="stats", transcript=tr)
        except ReleaseSkipped:
            pass
    assert keys.decrypted == 2
    assert up.skipped == [{"round": 2, "label": "stats",
                           "reason": WITHHELD, "uploads": 3, "min_clients": 2}]
    assert secure_participants(tr.entries) == [[0, 1, 2, 3], [0, 1, 4, 5]]
    assert [e["round"] for e in tr.entries if e["view"] == "aggregate"] == [1, 3]


def test_a_cohort_with_a_member_not_asked_leaves_the_sum():
    """The server asked five of six clients (client 4 lost in training): cohort (3, 4, 5)
    is not whole, so 3 and 5 are left out and the sum is cohort (0, 1, 2)'s."""
    up, keys = _uplink(COHORTS)
    tr = Transcript(None)
    asked = [0, 1, 2, 3, 5]
    total = up.aggregate(((c, _payload(c)) for c in asked), round_=2, label="stats",
                         transcript=tr, asked=asked)
    assert sorted(r["client"] for r in up.rejected) == [3, 5]
    assert all("cohort" in r["reason"] for r in up.rejected)
    assert secure_participants(tr.entries) == [[0, 1, 2]]
    expected = sum(_payload(c)["count"] for c in (0, 1, 2))
    assert torch.allclose(total["count"], expected, atol=1e-2)


def test_the_key_holder_refuses_a_sum_that_is_not_whole_cohorts():
    """The key holder's own rule, whatever the server asks: a contributor list is given,
    names no client twice, reaches the minimum and is a union of whole public cohorts."""
    assert check_contributors([0, 1, 2], 3, COHORTS) == 3
    assert check_contributors([3, 4, 5, 0, 1, 2], 3, COHORTS) == 6
    assert check_contributors([0, 4], 2, None) == 2  # no cohorts: the minimum alone
    for contributors, minimum, match in (([0, 1, 2, 3, 5], 3, "not whole cohorts"),
                                         ([0, 1, 1, 2], 3, "not whole cohorts"),
                                         (None, 3, "names no contributors"),
                                         ([0, 1, 2], 4, "below this key holder's minimum")):
        with pytest.raises(UploadRejected, match=match):
            check_contributors(contributors, minimum, COHORTS)


def test_the_in_process_key_holder_decrypts_no_partial_cohort():
    """The server side asks the key holder to open a sum of {0, 1, 2, 3, 5}: refused (the
    release is skipped with the key holder's reason), nothing decrypted."""
    up, keys = _uplink(COHORTS)
    stage = up.wire
    rel = up.release("stats", 1, [0, 1, 2, 3, 5], [0, 1, 2, 3, 5], _payload(0),
                     Transcript(None))
    up.open(rel)
    sealing = rel.state["sealing"]
    server = ServerAggregator(sealing.public, sealing.layout, n_threads=1)
    for c in rel.clients:
        server.add(unpad(sealing.seal(_payload(c))))
    with pytest.raises(ReleaseSkipped, match="key-holder-refused"):
        stage.keys.decrypt(server.result(), sealing.layout, rel, up.finish,
                           contributors=rel.clients)
    assert keys.decrypted == 1 and "key-holder" not in rel.state  # the key is gone


def test_dp_fedavg_scales_a_secure_sum_by_its_contributors(tmp_path, tiny_cfg):
    """--secagg-updates --dp-updates: a cohort left out of the round's CKKS sum (client 1's
    upload sent twice: the second is never summed, and cohort (1, 3) is not whole) leaves
    the other cohort's clipped, noised updates; the new global state is the global one plus
    their sum over the public denominator m = 4, not the average of two scaled by the four
    uploads. A sum not made leaves the global state as it was. Noise seeded
    (--insecure-seeded-noise) so that each share is redrawn here."""
    from privfedcal.experiment import build_simulator
    from privfedcal.federation.local import LocalResult
    from privfedcal.privacy.cohorts import cohort_plan
    from privfedcal.privacy.user_dp import UpdateLayout, UserDP, vector_norm

    cfg = tiny_cfg(rounds=2, secagg_updates=True, dp_updates=True, dp_eps=8.0,
                   insecure_seeded_noise=True)
    sim = build_simulator(cfg, tmp_path / "run")
    (a, b), (c, d) = cohort_plan(sim.exp.privacy).cohorts
    udp, glob = sim.uplink.find(UserDP), sim.global_state
    layout = UpdateLayout(glob)
    base = layout.flatten(glob)
    g = torch.Generator().manual_seed(3)
    states = {k: layout.unflatten(base + 0.01 * torch.randn(base.shape, generator=g,
                                                            dtype=torch.float64), cast=True)
              for k in (a, b, c, d)}
    selected = [a, b, c, d]

    class Trainer:
        def train(self, global_state, jobs, round_, consume=None):
            return [LocalResult(dict(states[k]), None, 0.1) for k in selected]

    def twice(global_state, sent, weights, clients, **kw):  # c's upload in d's place
        return sim.uplink.average_updates(global_state, sent, weights,
                                          [a, b, c, c], **kw)

    tr = Transcript(None)
    _, new, _, _ = udp.receive_round(Trainer(), [None] * 4, glob, selected, 1, tr, {},
                                     twice)
    shares = []
    for k in (a, b):  # each client's upload, redrawn from the seeded noise
        delta = layout.flatten(states[k]).sub_(base)
        udp.clip_and_share(delta, vector_norm(delta), 1, k, 4)
        shares.append(delta)
    expected = layout.unflatten(base + (shares[0] + shares[1]) / 4, cast=True)
    key = next(k for k, v in glob.items() if v.is_floating_point())
    assert {r["client"] for r in sim.uplink.rejected} == {c}  # moved into the run's list
    got, want = (new[key].double() - glob[key].double(),
                 expected[key].double() - glob[key].double())
    # within the key holder's flooding and rounding (~1% here); scaled by the four uploads
    # instead, the step would be twice as long
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())

    before = {k: v.clone() for k, v in glob.items()}
    _, new, _, _ = udp.receive_round(Trainer(), [None] * 4, glob, selected, 2, tr, {},
                               lambda gs, sent, w, clients, **kw: sim.uplink.average_updates(
                                   gs, sent, w, [a, a, c, c], **kw))  # nothing whole
    assert all(torch.equal(new[k], before[k]) for k in before)
