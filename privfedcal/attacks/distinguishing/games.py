"""Distinguishing games on the privacy channels: an empirical lower bound on epsilon.

A channel (``attacks/distinguishing/channels.py`` builds them from a run configuration) releases the
server's view of one client holding D or its neighbour D' (D plus one canary), through the
real release code with fresh noise from OS entropy; many trials run at once as a leading
batch dimension. ``play`` draws the same number of trials of each, reduces every view to a
few statistics, scores them, chooses the threshold on the first half of the trials and
counts errors on the second half (``privacy/empirical.split_bound``): the count of errors
of a fixed test bounds epsilon from below at the stated confidence (Jagielski, Ullman and
Oprea, NeurIPS 2020; Nasr et al., S&P 2021). docs/privacy/auditing.md says what the bound
means and what it does not.

Scores. With the noise-free views of D and D' known to the distinguisher (it chose the
canary), the optimal test of a Gaussian mechanism projects the release onto the difference
of the two means, each coordinate weighted by the inverse of its noise variance (the
likelihood ratio); the variance of each payload key is estimated on the first half of the D
trials, so a key sent without noise gets an unbounded weight and is caught. Without a
noise-free view (DP-SGD: the batches are random), the channel names its own statistics and
the game keeps the one (and the sign) whose calibration half bounds epsilon best.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.empirical import (
    SELECT_CONFIDENCE,
    choose_threshold,
    epsilon_lower_bound,
    errors_at,
)
from privfedcal.report.style.plotstyle import colour, new_figure, save, styled
from privfedcal.settings.messages import SettingError

#: the columns of dp_audit.csv, one row per channel; ``stopped`` is ``budget`` for a row whose
#: time budget ended it early (its bound counts the trials it ran), empty for a full one
COLUMNS = ("channel", "claimed_eps", "delta", "eps_lower", "confidence", "trials", "canary",
           "stopped")
CSV_NAME, PNG_NAME = "dp_audit.csv", "dp_audit.png"
#: fewest trials per side ``--trials`` may ask for
MIN_TRIALS = 20
#: fewest trials per side a time budget may stop a game at: one to choose the threshold on,
#: one to count (its bound is then 0: too few trials to refute anything, but a row)
BUDGET_MIN_TRIALS = 2
#: the ``stopped`` value of a row cut short by its time budget
BUDGET_STOP = "budget"
#: a variance estimate below this is a key released without noise
VAR_FLOOR = 1e-30

Views = dict[str, Tensor]     # payload key -> (trials, ...) server views
Stats = dict[str, np.ndarray]  # statistic -> (trials,) values


@dataclass
class Channel:
    """One channel of the threat-model table, ready to be audited.

    ``draw(n, canary)`` returns ``n`` independent server views of D (``canary`` False) or D'
    as tensors with a leading trial dimension. ``reference`` holds the noise-free views of
    (D, D'), one row each, when the distinguisher can know them; otherwise ``reduce`` maps
    views to the channel's own statistics."""

    name: str
    fields: tuple[str, ...]  # the client fields (privacy/client_fields.py) the views carry
    claimed_eps: float
    delta: float
    canary: str
    draw: Callable[[int, bool], Views]
    reference: tuple[Views, Views] | None = None
    reduce: Callable[[Views], Stats] | None = None
    chunk: int = 8192  # trials drawn at once (bounds memory: chunk x view size)

    def __post_init__(self) -> None:
        if (self.reference is None) == (self.reduce is None):
            raise ValueError(f"channel {self.name}: give a reference or a reduce, not both")

    def reduced(self, views: Views) -> Stats:
        """The statistics the distinguisher reads from ``views``: the channel's ``reduce``,
        else the projections on its ``reference``."""
        if self.reduce is not None:
            return self.reduce(views)
        if self.reference is None:
            raise ValueError(f"channel {self.name}: give a reference or a reduce")
        return projection_stats(views, self.reference)


def projection_stats(views: Views, reference: tuple[Views, Views]) -> Stats:
    """Per key k: the release's projection ``<v - m0, m1 - m0>`` and its squared residual
    ``|v - m0|^2 / size`` (what the variance is estimated from), per trial."""
    out: Stats = {}
    m0, m1 = reference
    for k, v in views.items():
        diff = (m1[k] - m0[k]).to(torch.float64).flatten()
        resid = (v.to(torch.float64) - m0[k].to(torch.float64)).flatten(1)
        out[f"proj:{k}"] = (resid @ diff).cpu().numpy()
        out[f"sq:{k}"] = (resid.square().mean(1)).cpu().numpy()
    return out


def projection_score(stats: Stats, fit: Stats, keys: list[str]) -> np.ndarray:
    """The likelihood-ratio score of a Gaussian release: the sum over keys of the projection
    divided by the key's noise variance, estimated on ``fit`` (the first half of D)."""
    score = np.zeros(len(stats[f"proj:{keys[0]}"]))
    for k in keys:
        var = max(float(np.mean(fit[f"sq:{k}"])), VAR_FLOOR)
        score = score + stats[f"proj:{k}"] / var
    return score


def _concat(parts: list[Stats]) -> Stats:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _scores(channel: Channel, neg: Stats, pos: Stats, half: int
            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Named scores of every trial (larger: D'), both signs of each statistic."""
    if channel.reference is not None:
        keys = sorted(channel.reference[0])
        fit = {k: v[:half] for k, v in neg.items()}
        return ({"projection": projection_score(neg, fit, keys)},
                {"projection": projection_score(pos, fit, keys)})
    s0, s1 = {}, {}
    for k in neg:
        for sign, name in ((1.0, f"+{k}"), (-1.0, f"-{k}")):
            s0[name], s1[name] = sign * neg[k], sign * pos[k]
    return s0, s1


def check_game(trials: int, confidence: float) -> None:
    """Refuse game options no game can run with (before any game starts)."""
    if trials < MIN_TRIALS:
        raise SettingError("{trials} must be >= {least}, got {got}", least=MIN_TRIALS, got=trials)
    if not 0 < confidence < 1:
        raise SettingError("{confidence} must be in (0, 1), got {got}", got=confidence)


def play(channel: Channel, trials: int, *, budget_s: float | None = None,
         confidence: float = 0.95,
         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run the game with ``trials`` releases of each of D and D' (fewer when ``budget_s``
    runs out, never fewer than ``BUDGET_MIN_TRIALS``) and return the channel's row of
    dp_audit.csv with the error counts behind it; a row the budget cut short has
    ``stopped`` = ``"budget"`` and a bound from the trials it ran.

    Under a budget the first chunk is ``BUDGET_MIN_TRIALS`` per side and every later one is
    sized from the time per trial so far to fit what is left of the budget (at most
    ``channel.chunk``), so that a slow channel (DP-SGD: one local training per trial)
    overruns its budget by about one trial, not by a chunk."""
    check_game(trials, confidence)
    reduce = channel.reduced
    parts: dict[bool, list[Stats]] = {False: [], True: []}
    done, t0 = 0, time.perf_counter()
    n = min(channel.chunk, trials, BUDGET_MIN_TRIALS if budget_s is not None else trials)
    while done < trials:
        for canary in (False, True):  # the same draws of both: the halves stay balanced
            parts[canary].append(reduce(channel.draw(n, canary)))
        done += n
        if progress is not None:
            progress(done, trials)
        n = min(channel.chunk, trials - done)
        if budget_s is not None and done < trials:
            spent = time.perf_counter() - t0
            if spent >= budget_s:
                break
            n = max(1, min(n, int((budget_s - spent) * done / spent) if spent > 0 else n))
    stopped = BUDGET_STOP if done < trials else ""
    neg, pos = _concat(parts[False]), _concat(parts[True])
    half = done // 2
    s0, s1 = _scores(channel, neg, pos, half)
    # the statistic, sign and threshold are chosen on the first half only ...
    select = max(confidence, SELECT_CONFIDENCE)
    chosen = max(((name, *choose_threshold(s0[name][:half], s1[name][:half], channel.delta,
                                           select)) for name in s0), key=lambda t: t[2])
    name, threshold = chosen[0], chosen[1]
    # ... and the errors that bound epsilon are counted on the second half
    fp, fn = errors_at(s0[name][half:], s1[name][half:], np.array([threshold]))
    n_test = done - half
    eps = epsilon_lower_bound(int(fp[0]), n_test, int(fn[0]), n_test, channel.delta,
                              confidence)
    return {"channel": channel.name, "claimed_eps": channel.claimed_eps,
            "delta": channel.delta, "eps_lower": eps, "confidence": confidence,
            "trials": 2 * done, "canary": channel.canary, "stopped": stopped, "score": name,
            "false_pos": int(fp[0]), "false_neg": int(fn[0]), "test_trials": 2 * n_test,
            "seconds": time.perf_counter() - t0}


def budget_spent(t0: float, budget_s: float | None) -> bool:
    """Whether ``budget_s`` seconds have passed since ``t0`` (``time.perf_counter``); never
    with no budget. The one-run audits check it between rounds or clients."""
    return budget_s is not None and time.perf_counter() - t0 >= budget_s


# ---- dp_audit.csv and its plot -----------------------------------------------------------------

def write_csv(rows: list[Mapping[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k])
                             for k in COLUMNS if k in r})
    return path


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a dp_audit.csv, numbers as floats (``inf`` for a channel without DP)."""
    try:
        with Path(path).open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    out = []
    for r in rows:
        try:
            out.append({"stopped": "", **r,  # a file written before the column: full rows
                        **{k: float(r[k]) for k in ("claimed_eps", "delta", "eps_lower",
                                                    "confidence", "trials")}})
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path} is not a dp_audit.csv (columns {', '.join(COLUMNS)})"
                             ) from None
    return out


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Claimed (hollow bar) and empirical lower bound (filled bar) of epsilon per channel;
    a channel without DP has no claimed bar, and its label says so, as does that of a row
    its time budget cut short."""
    with styled():
        fig = new_figure(max(4.0, 1.6 * len(rows) + 1.5), 3.6)
        ax = fig.subplots()
        x = np.arange(len(rows))
        for i, r in enumerate(rows):
            claimed = float(r["claimed_eps"])
            if math.isfinite(claimed):
                ax.bar(i - 0.18, claimed, 0.36, fill=False, edgecolor=colour(0), linewidth=1.5,
                       label="claimed" if i == 0 else None)
            ax.bar(i + 0.18, float(r["eps_lower"]), 0.36, color=colour(1),
                   label="empirical lower bound" if i == 0 else None)
            ax.annotate(f"{float(r['eps_lower']):.2f}", (i + 0.18, float(r["eps_lower"])),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [r["channel"] + ("" if math.isfinite(float(r["claimed_eps"]))
                                          else "\n(no DP)")
                          + ("\n(stopped by its time budget)" if r.get("stopped") else "")
                          for r in rows])
        conf = float(rows[0]["confidence"]) if rows else 0.95
        ax.set_ylabel(f"epsilon (lower bound at {100 * conf:g}%)")
        top = max([float(r["eps_lower"]) for r in rows] + [float(r["claimed_eps"]) for r in rows
                                                          if math.isfinite(float(r["claimed_eps"]))])
        ax.set_ylim(0, 1.2 * top if top > 0 else 1.0)  # room for the labels above the bars
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8,
                  frameon=False)
        ax.set_title("claimed vs empirical epsilon per channel", fontsize=10)
        return save(fig, path, dpi=110)


__all__ = ["BUDGET_MIN_TRIALS", "BUDGET_STOP", "COLUMNS", "CSV_NAME", "Channel", "PNG_NAME",
           "budget_spent", "check_game", "play", "plot", "projection_score",
           "projection_stats", "read_csv", "write_csv"]
