"""User-level DP of the model updates, DP-FedAvg (privacy/user_dp.py): the clip, the
sensitivity of the sum to one client's whole data, the noise (present, of the planned std,
from OS entropy), the accounting against opacus and pfl-research's published multiplier,
the end-to-end run, and the settings refused."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from privfedcal.errors import PrivacyBudgetError, UsageError
from privfedcal.federation.local import LocalResult
from privfedcal.privacy import user_dp
from privfedcal.privacy.accounting import PrivacyAccountant, plan_noise
from privfedcal.privacy.dp_accounting import DPAccounting
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.releases import UPDATE_RELEASE, USER_DP_RELEASE
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.user_dp import (
    UserDP,
    clip_update,
    distributed_share,
    model_delta,
    release_plan,
    update_norm,
)
from privfedcal.settings.floors import PrivacyOptions


class StatesTrainer:
    """Hands back fixed trained states, as a ``Trainer`` does: the DP pipeline sees states
    only, so the tests choose them (huge ones, to make the clip bind)."""

    def __init__(self, states):
        self.states = states

    def train(self, global_state, jobs, round_, consume=None):
        out = []
        for st in self.states:
            if consume is not None:
                consume(st)
                st = {}
            out.append(LocalResult(st, None, 0.25))
        return out


def stage(z=1.5, steps=3, target=50.0):
    return DPAccounting(target=target, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                   sigmas={USER_DP_RELEASE: z}, rates={USER_DP_RELEASE: 1.0}, clip=1.0,
                   grad_clip=1.0, distributed=False, covers_updates=False,
                   planned=[{"name": USER_DP_RELEASE, "sample_rate": 1.0, "steps": steps}])


def model_states(n, scale=10.0, seed=0, shape=(50, 40)):
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.randn(shape, generator=g), "b": torch.randn(shape[0], generator=g),
            "steps": torch.tensor(7)}
    states = [{"w": glob["w"] + scale * torch.randn(shape, generator=g),
               "b": glob["b"] + scale * torch.randn(shape[0], generator=g),
               "steps": torch.tensor(9)} for _ in range(n)]
    return glob, states


def one_round(udp, glob, states, round_=1, secure=None):
    return udp.receive_round(StatesTrainer(states), [None] * len(states), glob,
                             list(range(len(states))), round_, Transcript(None), {}, secure)


# ---- the clip -------------------------------------------------------------------------------
def test_clip_scales_the_whole_update_to_the_bound():
    delta = {"a": torch.tensor([3.0, 4.0], dtype=torch.float64),
             "b": torch.tensor([[12.0]], dtype=torch.float64)}
    assert update_norm(delta) == 13.0  # sqrt(9 + 16 + 144)
    out = clip_update(delta, 6.5)  # factor 6.5 / 13 = 0.5, the same for every entry
    assert out["a"].tolist() == [1.5, 2.0] and out["b"].tolist() == [[6.0]]
    inside = clip_update(delta, 13.0)
    assert all(torch.equal(inside[k], delta[k]) for k in delta)  # unchanged bit for bit
    rng = np.random.default_rng(1)
    big = {"x": torch.from_numpy(rng.normal(size=(7, 5))), "y": torch.from_numpy(rng.normal(size=9))}
    flat = np.concatenate([big["x"].numpy().ravel(), big["y"].numpy()])
    expect = flat * min(1.0, 0.8 / np.linalg.norm(flat))
    got = clip_update(big, 0.8)
    np.testing.assert_allclose(np.concatenate([got["x"].numpy().ravel(), got["y"].numpy()]),
                               expect, rtol=1e-12)
    with pytest.raises(UsageError):
        clip_update(delta, 0.0)


def test_delta_is_the_floating_entries_only():
    glob, (state,) = model_states(1)
    d = model_delta(state, glob)
    assert set(d) == {"w", "b"} and d["w"].dtype == torch.float64
    torch.testing.assert_close(d["w"], (state["w"] - glob["w"]).double())


def test_layout_lays_the_floating_entries_end_to_end_and_back():
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
             "steps": torch.tensor(7), "v": torch.tensor([0.5, -1.5], dtype=torch.float64),
             "s": torch.tensor(2.0)}
    layout = user_dp.UpdateLayout(state)
    assert layout.keys == ["w", "v", "s"] and layout.numel == 9  # no integer buffer
    flat = layout.flatten(state)
    assert flat.dtype == torch.float64
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0.5, -1.5, 2.0]
    back = layout.unflatten(flat, cast=True)
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype
               for k in layout.keys)
    flat.zero_()  # cast copies are the caller's own
    assert float(back["w"][1, 2]) == 5.0 and float(layout.unflatten(flat)["w"][1, 2]) == 0.0


@pytest.mark.parametrize("clip", [0.5, 1e6])  # binding, and an update already inside
def test_flat_client_update_is_the_whole_update_clip(clip):
    """The round's flat path (one float64 vector per update) gives the entry-by-entry
    formula of ``clip_update(model_delta(...))`` to float64 rounding, and the within bit."""
    glob, (state,) = model_states(1, scale=0.1)
    udp = UserDP(stage(), clip, denominator=1, distributed=False)
    got, within = udp.client_update(glob, state, 1, 0)
    expect = clip_update(model_delta(state, glob), clip)
    for k in ("w", "b"):
        np.testing.assert_allclose(got[k].numpy(), expect[k].numpy(), rtol=1e-13, atol=0)
    assert within == (update_norm(model_delta(state, glob)) <= clip)
    assert update_norm(got) <= clip * (1 + 1e-12)


def test_noise_of_entries_is_the_flat_draw_split():
    """``gaussian_noise`` (entries) and ``gaussian_vector`` (flat) draw the same numbers
    from the same generator, so the flat round and the entry-by-entry reference agree."""
    like = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    entries = user_dp.gaussian_noise(like, 0.7, torch.Generator().manual_seed(5))
    flat = user_dp.gaussian_vector(17, 0.7, torch.Generator().manual_seed(5))
    assert torch.equal(torch.cat([entries["a"].ravel(), entries["b"]]), flat)
    assert flat.dtype == torch.float64 and float(flat.abs().max()) > 0


# ---- sensitivity: one client's whole data present or absent ----------------------------------
def shift_of_one_client(clip=0.5, m=4):
    """How far the new global state moves, times m, when client 0's update is replaced by
    zero (its data absent), with the same noise draw in both runs (seeded: for this test
    only): the sensitivity of the sum of clipped updates, which must be <= clip."""
    glob, states = model_states(m, scale=10.0)
    absent = [{k: glob[k].clone() for k in glob}, *states[1:]]  # no data: no update
    outs = []
    for sts in (states, absent):
        udp = UserDP(stage(), clip, denominator=m, distributed=False, seed=3, seeded=True)
        outs.append(one_round(udp, glob, sts)[1])
    return m * math.sqrt(sum(float((outs[0][k].double() - outs[1][k].double()).pow(2).sum())
                             for k in ("w", "b")))


def test_one_clients_whole_data_moves_the_sum_by_at_most_the_clip():
    assert update_norm(model_delta(model_states(4)[1][0], model_states(4)[0])) > 100  # binds
    shift = shift_of_one_client(clip=0.5, m=4)
    assert shift == pytest.approx(0.5, rel=1e-5)  # the clip, up to float32 rounding


def test_without_the_clip_the_sensitivity_check_fails(monkeypatch):
    """The check above can fail: a pipeline that forgets to clip moves far beyond S."""
    monkeypatch.setattr(user_dp, "clip_factor", lambda norm, clip: 1.0)
    assert shift_of_one_client(clip=0.5, m=4) > 100


# ---- the noise ---------------------------------------------------------------------------------
def noise_std_of_sum(seeded=False, distributed=False, m=5, z=1.5, clip=0.2, seed=0):
    """Std per coordinate of (sum received - sum of clipped updates): the noise on the sum."""
    glob, states = model_states(m, scale=1.0, shape=(200, 100))
    udp = UserDP(stage(z=z), clip, denominator=m, distributed=distributed, seed=seed,
                 seeded=seeded)
    if distributed:  # a plain average stands in for the CKKS sum (tested in the e2e below)
        def secure(sent, uploads, weights, clients, round_, transcript):
            # recorded as the CKKS path records its aggregate: how many uploads it summed
            transcript.record(round_=round_, label=UPDATE_RELEASE, view="aggregate",
                              client=None, clients=len(uploads))
            return {k: sum(u[k].double() for u in uploads) / len(uploads) for k in uploads[0]}
    else:
        secure = None
    new = one_round(udp, glob, states, secure=secure)[1]
    clipped = [clip_update(model_delta(s, glob), clip) for s in states]
    noise = torch.cat([(m * (new[k].double() - glob[k].double())
                        - sum(c[k] for c in clipped)).ravel() for k in ("w", "b")])
    return float(noise.std()), noise


def test_central_noise_has_std_z_times_clip():
    std, noise = noise_std_of_sum(z=1.5, clip=0.2)  # 20,100 coordinates: std within ~1%
    assert std == pytest.approx(1.5 * 0.2, rel=0.03)
    assert abs(float(noise.mean())) < 0.01


def test_distributed_shares_carry_at_least_the_full_variance():
    m = 5
    assert distributed_share(m) == 0.25 and distributed_share(2) == 1.0
    std, _ = noise_std_of_sum(distributed=True, m=m, z=1.5, clip=0.2)
    # m shares of 1/(m-1): variance m/(m-1) (z S)^2, any m-1 of them the full (z S)^2
    assert std == pytest.approx(1.5 * 0.2 * math.sqrt(m / (m - 1)), rel=0.03)


def test_noise_is_fresh_os_entropy_and_seeded_only_on_request():
    a, b = noise_std_of_sum()[1], noise_std_of_sum()[1]
    assert not torch.equal(a, b)  # same seed, same inputs: different noise
    c, d = noise_std_of_sum(seeded=True)[1], noise_std_of_sum(seeded=True)[1]
    torch.testing.assert_close(c, d)  # --insecure-seeded-noise: regenerable from the seed


def test_without_noise_the_noise_check_fails(monkeypatch):
    monkeypatch.setattr(user_dp, "gaussian_vector",
                        lambda n, std, g: torch.zeros(n, dtype=torch.float64))
    assert noise_std_of_sum()[0] < 1e-5


# ---- the round: fixed denominator, no loss, buffers, divergence ------------------------------
def test_round_divides_by_the_public_denominator_and_releases_no_loss():
    """new = global + (sum of clipped updates + noise) / m, m the public denominator (6
    here, while 3 clients took part), with the noise regenerated from the seed (seeded for
    this test only)."""
    from privfedcal.privacy.noise import noise_generator

    glob, states = model_states(3, scale=1e-3)  # norms ~0.05: inside the clip, unchanged
    udp = UserDP(stage(z=1.5), 1.0, denominator=6, distributed=False, seed=4, seeded=True)
    results, new, _, checked = one_round(udp, glob, states)
    deltas = [model_delta(s, glob) for s in states]
    noise = user_dp.gaussian_noise(deltas[0], 1.5 * 1.0,
                                   noise_generator(4, 1, -1, 302, seeded=True))
    for k in ("w", "b"):
        expect = glob[k].double() + (sum(d[k] for d in deltas) + noise[k]) / 6
        torch.testing.assert_close(new[k].double(), expect, atol=1e-6, rtol=0)
    assert all(r.loss is None for r in results)  # a training loss is the client's data
    assert torch.equal(new["steps"], glob["steps"])  # integer buffers stay global
    assert all(c.state == {} for c in checked)


def test_noise_drawn_ahead_is_the_draw_at_the_sum_bit_for_bit(monkeypatch):
    """The server's noise is drawn on a thread while the clients train (``draw_ahead``),
    then scaled by the round's std: the same numbers as a draw at the sum, bit for bit
    (seeded here); one draw per round, and a draw for another round or size is not used."""
    from privfedcal.privacy import noise as noise_module

    glob, states = model_states(3, scale=1e-3)
    submitted: list[int] = []
    real = noise_module.draw_in_background
    monkeypatch.setattr(noise_module, "draw_in_background",
                        lambda draw: submitted.append(1) or real(draw))
    runs = []
    for ahead in (True, False):
        udp = UserDP(stage(z=1.5), 0.7, denominator=4, distributed=False, seed=4, seeded=True)
        if not ahead:
            monkeypatch.setattr(udp, "draw_ahead", lambda n, round_: None)
        before = len(submitted)
        runs.append((one_round(udp, glob, states, round_=3)[1], len(submitted) - before))
    (ahead_state, drawn_ahead), (inline_state, drawn_inline) = runs
    assert (drawn_ahead, drawn_inline) == (1, 0)
    for k in ("w", "b"):
        assert torch.equal(ahead_state[k], inline_state[k])
    udp = UserDP(stage(z=1.5), 0.7, denominator=4, distributed=False, seed=4, seeded=True)
    udp.draw_ahead(10, round_=2)  # another round: drawn now instead, from round 3's stream
    total = torch.zeros(10, dtype=torch.float64)
    udp.add_server_noise(total, 3)
    expect = user_dp.gaussian_vector(10, udp.std, noise_generator(4, 3, -1, 302, seeded=True))
    assert torch.equal(total, expect) and udp._ahead is None


def test_a_nonfinite_local_model_is_reported_not_summed():
    glob, states = model_states(2)
    states[1]["w"][0, 0] = float("nan")
    udp = UserDP(stage(), 1.0, denominator=2, distributed=False)
    _, new, _, checked = one_round(udp, glob, states)
    assert checked[0].state == {} and "w" in checked[1].state
    assert all(bool(torch.isfinite(v).all()) for v in new.values())


def test_every_round_charges_each_participant_and_the_plan_is_enforced():
    glob, states = model_states(2)
    dp = stage(z=1.5, steps=2, target=100.0)
    udp = UserDP(dp, 1.0, denominator=2, distributed=False)
    for r in (1, 2):
        one_round(udp, glob, states, round_=r)
    acc = PrivacyAccountant("rdp", 1e-5)
    acc.record(1.5, 1.0, 2)
    assert udp.user_epsilon() == pytest.approx(acc.epsilon(), rel=1e-12)
    assert dp.ledger(0).made == {USER_DP_RELEASE: 2}
    with pytest.raises(PrivacyBudgetError):  # the server's check: a third round was not planned
        one_round(udp, glob, states, round_=3)


# ---- accounting against opacus and pfl-research ------------------------------------------------
def test_noise_multiplier_matches_pfl_and_opacus():
    """pfl-research's user-level DP-FedAvg with RDP at epsilon 8, delta 1e-5, 20 rounds, 10
    of 10 clients (q = 1) uses noise multiplier 2.852; opacus' own search agrees."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    (z,) = plan_noise(8.0, 1e-5, [release_plan(20, None)], "rdp")
    assert z == pytest.approx(2.852, abs=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_noise_multiplier(target_epsilon=8.0, target_delta=1e-5, sample_rate=1.0,
                                   steps=20, accountant="rdp", epsilon_tolerance=1e-4)
        assert z == pytest.approx(ref, rel=2e-3)
        acc = RDPAccountant()
        for _ in range(20):
            acc.step(noise_multiplier=z, sample_rate=1.0)
        assert 7.98 <= acc.get_epsilon(delta=1e-5) <= 8.0


def test_plan_uses_q1_over_the_most_rounds_a_client_takes_part_in(tiny_cfg):
    from privfedcal.experiment import build_parts
    from privfedcal.privacy.planner import participation_counts

    cfg = tiny_cfg(clients=10, rounds=20, dp_updates=True, dp_eps=8.0, dp_delta=1e-5)
    _, _, up = build_parts(cfg)
    dp = up.find(UserDP).dp
    assert dp.rates == {USER_DP_RELEASE: 1.0} and up.find(UserDP).denominator == 10
    assert dp.planned == [{"name": USER_DP_RELEASE, "sample_rate": 1.0, "steps": 20}]
    assert dp.sigmas[USER_DP_RELEASE] == pytest.approx(2.852, abs=1e-3)
    half = tiny_cfg(clients=10, rounds=20, participation=0.5, dp_updates=True, dp_eps=8.0,
                    dp_delta=1e-5)
    _, _, up = build_parts(half)
    steps = max(participation_counts(PrivacyOptions.of(half)).values())
    assert up.find(UserDP).denominator == 5 and up.find(UserDP).dp.planned[0]["steps"] == steps
    (z,) = plan_noise(8.0, 1e-5, [release_plan(steps, None)], "rdp")
    assert up.find(UserDP).dp.sigmas[USER_DP_RELEASE] == pytest.approx(z)


def test_budget_is_split_with_the_calibration_release(tiny_cfg):
    from privfedcal.experiment import build_parts
    from privfedcal.privacy.accounting import compute_epsilon

    cfg = tiny_cfg(method="ccvr", rounds=5, dp_updates=True, dp_eps=8.0, dp_delta=1e-5,
                   dp_updates_share=0.75)
    _, _, up = build_parts(cfg)
    dp = up.find(UserDP).dp
    z = dp.sigmas[USER_DP_RELEASE]
    assert compute_epsilon([(z, 1.0, 5)], "rdp", 1e-5) == pytest.approx(6.0, rel=2e-3)
    total = compute_epsilon([(s, 1.0, p["steps"]) for s, p in
                             zip(dp.sigmas.values(), dp.planned, strict=True)], "rdp", 1e-5)
    assert 7.9 <= total <= 8.0


# ---- end to end ---------------------------------------------------------------------------------
def test_train_reports_the_user_level_budget_and_noise_differs_between_runs(tmp_path, capsys):
    from privfedcal.cli.main import main
    from privfedcal.federation.checkpoint import load_checkpoint
    from privfedcal.privacy.transcript import load_transcript

    finals = []
    for name in ("a", "b"):
        out = tmp_path / name
        main(["train", "--method", "fedavg", "--dp-updates", "--dp-eps", "8", "--clients",
              "5", "--rounds", "2", "--threads", "1", "--local-epochs", "1", "--device", "cpu",
              "--dp-update-clip", "0.5", "--data-seed", "0", "--out", str(out)])
        s = json.loads((out / "summary.json").read_text())
        p = s["privacy"]
        assert p["covers"] == "model updates (user-level DP-FedAvg)"
        assert 7.9 <= p["user_dp"]["epsilon_spent"] <= 8.0 and p["epsilon_spent"] <= 8.0
        assert p["user_dp"]["noise"] == "central" and p["user_dp"]["update_clip"] == 0.5
        finals.append(load_checkpoint(out / "final", "cpu")["model"])
        # the server's view: each update it received is the global state moved by <= S
        entries = load_transcript(out / "server" / "transcript")
        sent = {e["round"]: e["tensors"] for e in entries if e["label"] == "round"}
        ups = [e for e in entries if e["label"] == "model-update"]
        assert len(ups) == 10 and all(e["weight"] == 1.0 for e in ups)
        for e in ups:
            glob = sent[e["round"]]
            keys = [k for k in e["tensors"] if k in glob and glob[k].is_floating_point()]
            d = {k: e["tensors"][k].double() - glob[k].double() for k in keys}
            assert update_norm(d) <= 0.5 * (1 + 1e-4)
    assert any(not torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_secure_updates_carry_distributed_noise(tmp_path, tiny_cfg):
    from privfedcal.experiment import build_simulator
    from privfedcal.privacy.transcript import load_transcript

    cfg = tiny_cfg(rounds=1, secagg_updates=True, dp_updates=True, dp_eps=8.0,
                   transcript=True)
    summary = build_simulator(cfg, tmp_path / "s").run()
    p = summary["privacy"]
    assert p["user_dp"]["noise"] == "distributed" and p["user_dp"]["epsilon_spent"] <= 8.0
    views = [e["view"] for e in load_transcript(tmp_path / "s" / "server" / "transcript")
             if e["label"] == "model-update"]
    assert "plain-upload" not in views and views.count("aggregate") == 1


@pytest.mark.parametrize("args,needle", [
    (["--dp-updates"], "--dp-updates needs a budget"),
    (["--dp-updates", "--dp-eps", "8", "--dp-train"], "choose one"),
    (["--dp-update-clip", "2"], "belong(s) to user-level DP"),
    (["--method", "ccvr", "--dp-eps", "8", "--dp-updates-share", "0.3"],
     "belong(s) to user-level DP"),
    (["--dp-updates", "--dp-eps", "8", "--dp-update-clip", "0"], "--dp-update-clip"),
    (["--dp-updates", "--dp-eps", "8", "--dp-update-clip", "inf"], "--dp-update-clip"),
    (["--dp-updates", "--dp-eps", "8", "--dp-updates-share", "1"], "--dp-updates-share"),
])
def test_bad_combinations_are_refused(args, needle, capsys):
    from tests.cli.cli_helpers import assert_usage_error

    assert_usage_error(["train", *args, "--device", "cpu", "--threads", "1"], capsys, needle)


@pytest.mark.flower
# ---- adaptive clipping (privacy/adaptive_clip.py) --------------------------------------------
def test_count_and_updates_share_the_rounds_multiplier():
    from privfedcal.privacy.adaptive_clip import count_noise_std, update_multiplier

    assert update_multiplier(2.0, 4.0) == pytest.approx(4 / math.sqrt(3))  # (1/4 - 1/16)^-1/2
    z = 1.3
    sb = count_noise_std(z, 10)  # ten clients: the privacy share decides, z / sqrt(0.1)
    assert sb == pytest.approx(z / math.sqrt(0.1))
    assert count_noise_std(z, 1000) == 50.0  # many clients: the paper's m / 20
    zu = update_multiplier(z, sb)
    assert zu ** -2 + sb ** -2 == pytest.approx(z ** -2, rel=1e-12)  # one Gaussian of z
    assert zu == pytest.approx(z / math.sqrt(0.9))
    with pytest.raises(UsageError):
        update_multiplier(2.0, 1.5)


def states_with_norms(norms, seed=0):
    """A global state and one state per norm whose update has exactly that L2 norm."""
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.zeros(30, dtype=torch.float64)}
    out = []
    for n in norms:
        d = torch.randn(30, generator=g, dtype=torch.float64)
        out.append({"w": d * (n / d.norm())})
    return glob, out


def test_adaptive_clip_takes_the_papers_geometric_step():
    from privfedcal.privacy.adaptive_clip import AdaptiveClip
    from privfedcal.privacy.noise import noise_generator

    glob, states = states_with_norms([0.5, 0.8, 3.0, 4.0])  # 2 of 4 within a clip of 1
    udp = UserDP(stage(z=1.0), 1.0, denominator=4, distributed=False, seed=9, seeded=True,
                 adaptive=AdaptiveClip(0.75))
    one_round(udp, glob, states)
    draw = float(torch.randn((), generator=noise_generator(9, 1, -1, 303, seeded=True),
                             dtype=torch.float64))
    b = (2 + udp.count_std * draw) / 4
    assert udp.clip == pytest.approx(math.exp(-0.2 * (b - 0.75)), rel=1e-12)
    assert udp.std == pytest.approx(udp.update_multiplier * udp.clip)
    assert udp.summary()["user_dp"]["adaptive_clip"]["initial_clip"] == 1.0


def test_adaptive_clip_settles_near_the_target_quantile():
    from privfedcal.privacy.adaptive_clip import AdaptiveClip

    norms = list(np.linspace(1.0, 40.0, 40))  # median 20.5
    glob, states = states_with_norms(norms)
    udp = UserDP(stage(z=0.5, steps=80, target=1e4), 1.0, denominator=40, distributed=False,
                 adaptive=AdaptiveClip(0.5))
    for r in range(1, 81):
        one_round(udp, glob, states, round_=r)
    assert 16.0 < udp.clip < 25.0  # from 1.0 (20 trials: 19.1 to 20.9); count noise std 2
    restored = UserDP(stage(z=0.5, steps=80, target=1e4), 1.0, denominator=40,
                      distributed=False,
                      adaptive=AdaptiveClip(0.5))
    restored.load_state_dict(udp.state_dict())  # resume keeps the clip
    assert restored.clip == udp.clip


def test_adaptive_clip_runs_end_to_end(tmp_path, tiny_cfg):
    from privfedcal.experiment import build_simulator

    cfg = tiny_cfg(rounds=2, dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True,
                   dp_clip_quantile=0.7)
    p = build_simulator(cfg, tmp_path / "a").run()["privacy"]["user_dp"]
    assert p["adaptive_clip"]["quantile"] == 0.7 and p["update_clip"] != 1.0
    assert 7.9 <= p["epsilon_spent"] <= 8.0


@pytest.mark.parametrize("args,needle", [
    (["--dp-adaptive-clip"], "belong(s) to user-level DP"),
    (["--dp-updates", "--dp-eps", "8", "--dp-clip-quantile", "0.9"],
     "--dp-clip-quantile belongs to --dp-adaptive-clip"),
    (["--dp-updates", "--dp-eps", "8", "--dp-adaptive-clip", "--dp-clip-quantile", "1"],
     "--dp-clip-quantile must be in (0, 1)"),
    (["--dp-updates", "--dp-eps", "8", "--dp-adaptive-clip", "--secagg-updates"],
     "central noise only"),
])
def test_bad_adaptive_settings_are_refused(args, needle, capsys):
    from tests.cli.cli_helpers import assert_usage_error

    assert_usage_error(["train", *args, "--device", "cpu", "--threads", "1"], capsys, needle)


def test_schedule_holds_with_thousands_of_clients():
    """2,000 clients, 100 per round, 30 rounds: the plan is q = 1 over the most rounds any
    client is selected in (public), and the whole schedule runs through every client's
    ledger and the server's check without a refusal, the worst-off client ending within
    the budget."""
    from types import SimpleNamespace

    from privfedcal.federation.hooks import Calibrator
    from privfedcal.privacy.cohorts import select_clients
    from privfedcal.privacy.planner import build_uplink, participation_counts
    from privfedcal.settings.run_config import RunConfig

    cfg = RunConfig.of(clients=2000, participation=0.05, rounds=30, dp_updates=True, dp_eps=8.0,
                    dp_delta=1e-6)
    udp = build_uplink(cfg, SimpleNamespace(num_examples=100_000), Calibrator()).find(UserDP)
    steps = max(participation_counts(PrivacyOptions.of(cfg)).values())
    assert udp.denominator == 100 and udp.dp.planned[0]["steps"] == steps > 1
    (z,) = plan_noise(8.0, 1e-6, [release_plan(steps, None)], "rdp")
    assert udp.noise_multiplier == pytest.approx(z)
    for r in range(1, cfg.training.rounds + 1):
        chosen = select_clients(PrivacyOptions.of(cfg), r)
        udp.admit_round(chosen)
        udp.charge_round(chosen)
    assert 7.9 <= udp.user_epsilon() <= 8.0
    worst = max(udp.dp.ledgers.values(), key=lambda g: g.made[USER_DP_RELEASE])
    assert worst.made[USER_DP_RELEASE] == steps


def test_resume_keeps_the_clip_the_ledgers_and_the_accountants(tmp_path, tiny_cfg):
    from privfedcal.experiment import build_simulator

    cfg = tiny_cfg(rounds=2, dp_updates=True, dp_eps=8.0, dp_adaptive_clip=True)
    sim = build_simulator(cfg, tmp_path / "r")
    sim.run()
    again = build_simulator(cfg, tmp_path / "r")
    again.restore()  # the last round's checkpoint
    a, b = sim.uplink.find(UserDP), again.uplink.find(UserDP)
    assert b.clip == a.clip != 1.0
    assert {c: g.made for c, g in b.dp.ledgers.items()} == {c: g.made for c, g in
                                                           a.dp.ledgers.items()}
    assert b.user_epsilon() == a.user_epsilon() > 0


def test_noised_batchnorm_variance_stays_a_variance():
    glob = {"bn.running_var": torch.full((2000,), 1e-3), "bn.running_mean": torch.zeros(2000)}
    states = [{k: v + 1e-4 for k, v in glob.items()} for _ in range(2)]
    udp = UserDP(stage(z=5.0), 1.0, denominator=2, distributed=False)
    new = one_round(udp, glob, states)[1]
    assert float(new["bn.running_var"].min()) == 0.0  # the noise pushed some below 0: clamped
    assert float(new["bn.running_mean"].min()) < 0  # other entries are left as noised


def test_distributed_share_follows_the_rounds_public_selection():
    """Under cohorts a round may select more clients than m (7 clients at 0.5: 4 or 5); each
    participant adds 1/(n - 1) for the round's n, so any n - 1 shares carry the full
    variance whatever the round's size."""
    from privfedcal.privacy.cohorts import select_clients
    from privfedcal.settings.run_config import RunConfig

    cfg = RunConfig.of(clients=7, participation=0.5, rounds=6, secagg_updates=True,
                    dp_updates=True, dp_eps=8.0)
    sizes = {len(select_clients(PrivacyOptions.of(cfg), r)) for r in range(1, 7)}
    assert sizes == {4, 5}  # the selection this test is about
    udp = UserDP(stage(), 1.0, denominator=4, distributed=True)
    assert udp.client_share(5) == 0.25 and udp.client_share() == 1 / 3
    std, _ = noise_std_of_sum(distributed=True, m=5, z=1.5, clip=0.2)
    assert std == pytest.approx(1.5 * 0.2 * math.sqrt(5 / 4), rel=0.03)


def test_the_statement_names_the_level_its_releases_hold_at():
    # DP-FedAvg alone: one client's whole data; beside a sample-level release (a calibration
    # upload) the composed guarantee is per example, and DP-SGD's batches are assumed only
    # where DP-SGD runs
    alone = stage().summary()
    assert "at user level (one client's whole data)" in alone["statement"]
    assert "sample level" not in alone["statement"].split(";")[0]
    assert alone["assumptions"][0].startswith("user-level DP")
    assert not any(a.startswith("DP-SGD's") for a in alone["assumptions"])
    both = DPAccounting(target=50.0, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                   sigmas={USER_DP_RELEASE: 1.5, "ccvr-stats": 2.0},
                   rates={USER_DP_RELEASE: 1.0, "ccvr-stats": 1.0}, clip=1.0, grad_clip=1.0,
                   distributed=False, covers_updates=False,
                   planned=[{"name": USER_DP_RELEASE, "sample_rate": 1.0, "steps": 3},
                            {"name": "ccvr-stats", "sample_rate": 1.0, "steps": 1}]).summary()
    assert "per example, sample level" in both["statement"]
    assert both["assumptions"][0].startswith("sample-level DP")
