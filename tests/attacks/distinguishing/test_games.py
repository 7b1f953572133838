"""The distinguishing game of ``attacks/distinguishing/games.py`` on synthetic channels whose epsilon is
known in closed form: the bound stays below the exact epsilon of a Gaussian mechanism and
reaches half of it; a key without noise and a leaking statistic are found; the csv and the
plot."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from privfedcal.attacks.distinguishing import games
from privfedcal.attacks.distinguishing.games import (
    BUDGET_MIN_TRIALS,
    BUDGET_STOP,
    COLUMNS,
    MIN_TRIALS,
    Channel,
    play,
    plot,
    projection_score,
    projection_stats,
    read_csv,
    write_csv,
)
from privfedcal.errors import UsageError
from privfedcal.privacy.empirical import epsilon_lower_bound

PNG = b"\x89PNG\r\n\x1a\n"


def gaussian_eps(mu: float, delta: float) -> float:
    """Exact epsilon of a Gaussian mechanism with sensitivity / std = mu (Balle & Wang 2018,
    Thm 8): the root of Phi(-e/mu + mu/2) - e^e Phi(-e/mu - mu/2) = delta."""
    def excess(e: float) -> float:
        return norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta

    return brentq(excess, 0.0, 100.0)


def gaussian_channel(mu: float, seed: int, *, clear: bool = False) -> Channel:
    """Two keys: ``a`` (2 coordinates, std 2) moved by (2 mu, 0), and ``b`` (std 1, or no
    noise with ``clear``) moved by 0.5; without ``clear`` the likelihood ratio is that of a
    Gaussian with mu_total = sqrt(mu^2 + 0.25)."""
    g = torch.Generator().manual_seed(seed)
    m0 = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64)}
    m1 = {"a": torch.tensor([2 * mu, 0.0], dtype=torch.float64),
          "b": torch.tensor([0.5], dtype=torch.float64)}

    def draw(n, canary):
        m = m1 if canary else m0
        return {"a": m["a"] + 2 * torch.randn(n, 2, generator=g, dtype=torch.float64),
                "b": m["b"] + (0.0 if clear else 1.0) * torch.randn(n, 1, generator=g,
                                                                    dtype=torch.float64)}

    return Channel("toy", ("toy/a", "toy/b"), 1.0, 1e-5, "toy", draw, reference=(m0, m1),
                   chunk=1 << 16)


def test_projection_stats_and_score_by_hand():
    ref = ({"a": torch.tensor([0.0, 1.0])}, {"a": torch.tensor([3.0, 1.0])})
    views = {"a": torch.tensor([[1.0, 2.0], [4.0, 1.0]])}
    st = projection_stats(views, ref)
    # residuals (1, 1) and (4, 0); difference (3, 0): projections 3 and 12
    assert st["proj:a"].tolist() == [3.0, 12.0]
    assert st["sq:a"].tolist() == [1.0, 8.0]               # |r|^2 / 2
    fit = {"sq:a": np.array([1.0, 3.0])}                     # variance 2
    assert projection_score(st, fit, ["a"]).tolist() == [1.5, 6.0]


@pytest.mark.parametrize("mu", [0.6, 1.6])
def test_gaussian_bound_is_below_the_exact_epsilon_and_above_half(mu):
    mu_total = math.sqrt(mu ** 2 + 0.25)
    exact = gaussian_eps(mu_total, 1e-5)
    row = play(gaussian_channel(mu, seed=1), 400_000)
    assert row["score"] == "projection"
    assert row["trials"] == 800_000 and row["test_trials"] == 400_000
    assert row["eps_lower"] < exact
    assert row["eps_lower"] > exact / 2, (row, exact)
    assert row["eps_lower"] == pytest.approx(epsilon_lower_bound(
        row["false_pos"], 200_000, row["false_neg"], 200_000, 1e-5, 0.95))


def test_a_key_without_noise_is_caught():
    # b moves by 0.5 with no noise: every test trial is classified right
    row = play(gaussian_channel(0.1, seed=2, clear=True), 5_000)
    assert (row["false_pos"], row["false_neg"]) == (0, 0)
    u = 1 - 0.025 ** (1 / 2500)                             # Clopper-Pearson, 0 of 2,500
    assert row["eps_lower"] == pytest.approx(math.log((1 - 1e-5 - u) / u))


def test_a_statistic_channel_picks_the_leaking_statistic_and_its_sign():
    g = torch.Generator().manual_seed(3)

    def draw(n, canary):
        return {"x": torch.randn(n, generator=g) - (3.0 if canary else 0.0)}

    def reduce(v):
        return {"noise": torch.randn(len(v["x"]), generator=g).numpy(), "x": v["x"].numpy()}

    ch = Channel("stat", ("s",), 1.0, 0.0, "toy", draw, reduce=reduce, chunk=500)
    row = play(ch, 4_000)
    assert row["score"] == "-x"                             # D' is smaller
    assert row["eps_lower"] > 2.0


def test_budget_stops_after_the_first_chunk_and_bad_arguments():
    ch = gaussian_channel(1.0, seed=4)
    ch.chunk = 64
    seen = []
    row = play(ch, 10_000, budget_s=1e-9, progress=lambda d, t: seen.append((d, t)))
    # the first chunk under a budget is the minimum: one trial per side to choose on, one
    # to count; the row says the budget stopped it and bounds epsilon from those trials
    assert row["trials"] == 2 * BUDGET_MIN_TRIALS and seen == [(BUDGET_MIN_TRIALS, 10_000)]
    assert row["stopped"] == BUDGET_STOP and row["test_trials"] == BUDGET_MIN_TRIALS
    assert row["eps_lower"] == 0.0                      # one counted trial per side
    assert play(ch, 200, budget_s=1e9)["stopped"] == ""  # a game that ran every trial
    with pytest.raises(UsageError, match="trials"):
        play(ch, MIN_TRIALS - 1)
    with pytest.raises(UsageError, match="confidence"):
        play(ch, 100, confidence=1.0)
    with pytest.raises(ValueError, match="not both"):
        Channel("x", (), 1.0, 0.0, "", ch.draw)


def test_chunks_after_the_first_fit_what_is_left_of_the_budget(monkeypatch):
    """A slow channel (a clock that a trial advances by half a second per side) with a
    budget of 10 s: the first chunk (2 per side) takes 2 s, so the next is sized to the
    8 s left (8 per side, not the channel's chunk of 16) and the game stops at 10 s with
    10 trials per side; drawing whole chunks it would have run 32 per side (32 s)."""
    clock = [0.0]
    monkeypatch.setattr(games, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    ch = gaussian_channel(1.0, seed=5)
    draw = ch.draw

    def slow(n, canary):
        clock[0] += 0.5 * n
        return draw(n, canary)

    ch.draw, ch.chunk = slow, 16
    sizes = []
    row = play(ch, 1_000, budget_s=10.0, progress=lambda d, t: sizes.append(d))
    assert sizes == [2, 10] and row["trials"] == 20 and row["stopped"] == BUDGET_STOP
    assert row["seconds"] == 10.0


def test_csv_round_trip_and_plot(tmp_path):
    rows = [{"channel": "ccvr-stats", "claimed_eps": 1.0, "delta": 1e-5, "eps_lower": 0.41,
             "confidence": 0.95, "trials": 400000, "canary": "a, b", "score": "projection"},
            {"channel": "creff-grad", "claimed_eps": math.inf, "delta": 0.0, "eps_lower": 9.1,
             "confidence": 0.95, "trials": 4, "canary": "c", "stopped": BUDGET_STOP}]
    path = write_csv(rows, tmp_path / "dp_audit.csv")
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    back = read_csv(path)
    assert back[0]["canary"] == "a, b" and back[1]["claimed_eps"] == math.inf
    assert back[0]["eps_lower"] == 0.41 and back[0]["trials"] == 400000
    assert (back[0]["stopped"], back[1]["stopped"]) == ("", BUDGET_STOP)
    older = tmp_path / "older.csv"  # written before the column: its rows ran in full
    older.write_text("\n".join(",".join(line.split(",")[:-1]) for line in
                               path.read_text().splitlines()) + "\n")
    assert [r["stopped"] for r in read_csv(older)] == ["", ""]
    assert plot(back, tmp_path / "p.png").read_bytes()[:8] == PNG
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UsageError, match="not a dp_audit.csv"):
        read_csv(tmp_path / "bad.csv")
