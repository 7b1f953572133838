"""Each invariant on hand-made server views: it passes a clean one and names the flaw in a
broken one (so a checker that sees nothing cannot pass these tests)."""

from __future__ import annotations

from opacus.accountants import RDPAccountant

from .accounting import charged, recomputed
from .invariants import count_splits, isolation
from .schema import records, timing
from .view import Release, ServerView, merge

SIGMA = 1.104906150745947  # the noise multiplier of epsilon 8 over 3 releases at q = 1


def view(releases, clients=4, summary=None, **config) -> ServerView:
    cfg = {"clients": clients, "rounds": 6, "secagg": True, "secagg_min_clients": 2,
           **config}
    return ServerView(cfg, summary, [], list(releases))


def agg(round_, who, digest="x", counts=None, label="creff-grad") -> Release:
    return Release(round_, label, "aggregate", tuple(who), f"{digest}{round_}", counts)


def test_isolation_names_the_client_a_lost_member_leaves():
    whole = view([agg(1, [0, 1, 2, 3]), agg(2, [0, 1]), agg(3, [2, 3])])
    assert isolation(whole) == []
    lost = view([agg(1, [0, 1, 2, 3]), agg(2, [0, 1, 3])])  # client 2 lost in round 2
    assert [v.detail for v in isolation(lost)] == [
        "the server determines a combination of clients [2] (fewer than 2)"]


def test_isolation_counts_an_observers_own_values():
    """Cohorts of 3 and m = 3: the key holder (client 0) learns the sum of clients 1 and 2,
    a group of 2."""
    v = view([agg(1, range(6)), agg(2, [0, 1, 2])], clients=6, secagg_min_clients=3)
    assert isolation(v) == []  # to the server: cohorts of 3 only
    assert "observer holding client 0" in isolation(v, observers=(0,))[0].detail


def sized(weights):
    return [Release(1, "model-update", "plain-upload", (c,), f"u{c}", None, w)
            for c, w in enumerate(weights)]


def test_clear_sizes_split_a_pair_with_no_shared_class():
    # cohorts (0, 1), (2, 3); sizes in the clear; client 0 holds class 0 alone, client 1
    # class 2 alone; clients 2 and 3 share class 1, so no subset-sum split exists for them
    counts = [[30, 0, 20, 0], [0, 40, 0, 5]]
    releases = [agg(1, [0, 1], counts=counts[0]), agg(2, [2, 3], counts=counts[1]),
                *sized([30, 20, 35, 10])]
    (v,) = count_splits(view(releases))
    assert v.found == ((0, (30, 0, 0, 0)), (1, (0, 0, 20, 0)))
    # equal (public) weights are no sizes; noisy counts (DP) are not split
    assert count_splits(view([*releases[:2], *sized([1, 1, 1, 1])])) == []
    assert count_splits(view(releases, dp_eps=8.0)) == []


def dp_summary(per_client=7.996276843081613, target=8.0) -> dict:
    return {"privacy": {"epsilon_spent": per_client, "epsilon_target": target,
                        "delta": 1e-5, "releases": [{"label": "creff-grad",
                                                     "noise_multiplier": SIGMA,
                                                     "sample_rate": 1.0, "steps": 6}],
                        "client_release_limits": {"creff-grad": 3},
                        "per_client_epsilon": {"0": per_client, "1": per_client}}}


def test_charged_recomputes_opacus_and_counts_a_release_made_twice():
    made = [agg(r, [0, 1]) for r in (1, 2, 3)]
    v = view(made, summary=dp_summary())
    acc = RDPAccountant()
    acc.history = [(SIGMA, 1.0, 3)]
    assert abs(recomputed(v)[0] - acc.get_epsilon(1e-5)) < 1e-12
    assert charged(v) == []
    again = merge([view([agg(3, [0, 1], digest="first-draw")], summary=dp_summary()), v])
    assert len(again.releases) == 4  # round 3 twice, with two noise draws
    details = [x.detail for x in charged(again)]
    assert any("worth epsilon 9.501, reported 7.996" in d for d in details), details
    assert any("over the target 8" in d for d in details), details


def test_records_flag_private_numbers_undeclared_fields_and_files():
    bound = {"privacy": {"secagg": {"params": {"m": {"max_abs_sum": 135946.0}}}}}
    ok = {**bound, "skipped_releases": [
        {"round": 3, "label": "model-update",
         "reason": "round 3 model-update: entry exceeds the declared bound 135946"}],
          "notes": ["extended from 4 to 6 rounds"]}
    v = view([], summary=ok)
    v.files = ["config.json", "summary.json", "transcript/index.json",
               "transcript/00001-r1-model-update-plain-upload-c0.safetensors"]
    assert records(v) == []
    bad = {**ok, "skipped_releases": [{"round": 3, "label": "model-update",
                                       "reason": "aggregate entry 5.1e+07 exceeds 135946"}],
           "secret": 1}
    v.summary, v.files = bad, [*v.files, "server.log"]
    details = [x.detail for x in records(v)]
    assert any("non-public number(s) ['5.1e+07']" in d for d in details), details
    assert "undeclared field summary.json:secret" in details
    assert "undeclared file server/server.log" in details


def test_records_want_every_missing_upload_listed_and_no_diverged_client():
    v = view([], summary={"rejected_uploads": [
        {"round": 1, "label": "model-update", "client": 2, "reason": "does not fit"}],
        "diverged": {"round": 1, "client": None, "what": "loss", "hint": "lower the lr"}},
        secagg=False, secagg_updates=True)
    v.entries = [{"round": 1, "label": "round", "view": "model-state", "client": None,
                  "participants": [0, 1, 2]},
                 *({"round": 1, "label": "model-update", "view": "ciphertext", "client": c}
                   for c in (0, 1)),
                 {"round": 1, "label": "model-update", "view": "aggregate", "client": None}]
    assert records(v) == []
    v.summary = {"diverged": {"round": 1, "client": 1, "what": "loss", "hint": "lower"}}
    details = [x.detail for x in records(v)]
    assert any("client 2's upload is missing" in d for d in details), details
    assert any("names a client" in d for d in details), details


def test_timing_wants_one_time_per_round_for_per_client_files():
    v = view([])
    v.mtimes = {"transcript/00001-r1-model-update-plain-upload-c0.safetensors": 5,
                "transcript/00002-r1-model-update-plain-upload-c1.safetensors": 5,
                "transcript/00003-r1-round-model-state.safetensors": 3}
    assert timing(v) == []
    v.mtimes["transcript/00004-r1-model-update-plain-upload-c2.safetensors"] = 9
    assert [x.detail for x in timing(v)] == [
        "round 1: its per-client files carry 2 distinct modification times"]
