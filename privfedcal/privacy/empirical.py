"""Empirical lower bounds on epsilon from a distinguishing game (Jagielski et al. 2020).

A distinguisher guesses, from one release, whether it came from dataset D or its neighbour
D'. If the release is (epsilon, delta)-DP, every distinguisher's false-positive rate FPR and
false-negative rate FNR satisfy ``FPR + e^eps FNR >= 1 - delta`` and
``FNR + e^eps FPR >= 1 - delta`` (Kairouz et al. 2015). Upper confidence bounds on both
rates (Clopper-Pearson, each at ``1 - (1 - confidence) / 2`` so that both hold together)
turn observed error counts into a lower bound on epsilon that holds with ``confidence``.
A bound above the claimed epsilon means the claim is false (with that confidence); a bound
below it proves nothing about the claim.

``split_bound`` turns the scores of a game into such a bound: a threshold chosen on half of
the trials (the one with the largest bound, usually in a tail), errors counted on the other
half. One threshold on n trials per side cannot certify more than about ``log(n / 3.7)``
(no errors at all), so a tight bound at a large epsilon needs many trials
(docs/privacy/auditing.md).

``one_run_epsilon`` is the bound of one run with many canaries (Steinke, Nasr and
Jagielski, NeurIPS 2023): each canary is included with probability 1/2, the auditor guesses
some of them, and the count of right guesses refutes every epsilon whose randomised-response
accuracy makes that count improbable.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import beta, binom


def clopper_pearson_upper(k: int, n: int, confidence: float) -> float:
    """One-sided upper bound on a binomial rate after ``k`` successes in ``n`` trials."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if k == n:
        return 1.0
    return float(beta.ppf(confidence, k + 1, n - k))


def epsilon_lower_bound(false_pos: int, negatives: int, false_neg: int, positives: int,
                        delta: float = 0.0, confidence: float = 0.95) -> float:
    """Lower bound on epsilon, holding with ``confidence``, from a distinguisher's errors:
    ``false_pos`` of ``negatives`` trials on D called D', ``false_neg`` of ``positives``
    trials on D' called D. 0 when the errors are consistent with any epsilon."""
    each = 1 - (1 - confidence) / 2                    # Bonferroni over the two rates
    fpr = clopper_pearson_upper(false_pos, negatives, each)
    fnr = clopper_pearson_upper(false_neg, positives, each)
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        num = 1 - delta - a
        if num > 0 and b > 0:
            best = max(best, math.log(num / b))
    return best


def epsilon_lower_bounds(false_pos: np.ndarray, negatives: int, false_neg: np.ndarray,
                         positives: int, delta: float = 0.0,
                         confidence: float = 0.95) -> np.ndarray:
    """``epsilon_lower_bound`` at many thresholds at once: arrays of error counts in, one
    bound per entry out (the same Bonferroni split and Clopper-Pearson bounds)."""
    fp, fn = np.asarray(false_pos, dtype=np.int64), np.asarray(false_neg, dtype=np.int64)
    if negatives <= 0 or positives <= 0 or fp.min(initial=0) < 0 or fn.min(initial=0) < 0 \
            or fp.max(initial=0) > negatives or fn.max(initial=0) > positives:
        raise ValueError("need 0 <= errors <= trials and trials > 0")
    each = 1 - (1 - confidence) / 2

    def upper(k: np.ndarray, n: int) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            u = beta.ppf(each, k + 1, n - k)
        return np.where(k >= n, 1.0, u)

    fpr, fnr = upper(fp, negatives), upper(fn, positives)
    best = np.zeros(np.broadcast(fpr, fnr).shape)
    for a, b in ((fpr, fnr), (fnr, fpr)):
        num = 1 - delta - a
        with np.errstate(divide="ignore", invalid="ignore"):
            val = np.where((num > 0) & (b > 0), np.log(np.maximum(num, 1e-300) / b), 0.0)
        best = np.maximum(best, val)
    return best


def errors_at(neg: np.ndarray, pos: np.ndarray, thresholds: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """(false positives, false negatives) of the rule "score > t means D'" at each
    threshold t: negatives (scores of D) above t, positives (scores of D') at or below t."""
    neg, pos = np.sort(np.asarray(neg, dtype=np.float64)), np.sort(np.asarray(pos, dtype=np.float64))
    t = np.asarray(thresholds, dtype=np.float64)
    fp = len(neg) - np.searchsorted(neg, t, side="right")
    fn = np.searchsorted(pos, t, side="right")
    return fp, fn


def choose_threshold(neg: np.ndarray, pos: np.ndarray, delta: float = 0.0,
                     confidence: float = 0.95) -> tuple[float, float]:
    """The threshold whose bound on these scores is largest, and that bound.

    The candidates lie between neighbouring scores (up to 4,096 of them, evenly spaced in
    rank, plus the 64 most extreme of each end), so that a threshold in either tail (few
    false positives, or few false negatives) is always tried: the bound of a Gaussian
    mechanism is largest in a tail, not where accuracy is."""
    scores = np.sort(np.concatenate([np.asarray(neg, float), np.asarray(pos, float)]))
    if len(scores) > 4096:
        ranks = np.unique(np.concatenate([np.linspace(0, len(scores) - 1, 4096).astype(int),
                                          np.arange(64), len(scores) - 1 - np.arange(64)]))
        scores = scores[ranks]
    # midpoints between neighbouring scores: a threshold in the middle of a gap errs least
    # on new trials; -inf calls everything D'
    scores = np.unique(scores)
    candidates = np.concatenate([[-np.inf], scores[:-1] + (scores[1:] - scores[:-1]) / 2,
                                 [scores[-1]]])
    fp, fn = errors_at(neg, pos, candidates)
    bounds = epsilon_lower_bounds(fp, len(neg), fn, len(pos), delta, confidence)
    i = int(np.argmax(bounds))
    return float(candidates[i]), float(bounds[i])


#: the confidence at which thresholds are compared while choosing one: stricter than the
#: reported one, so that a tail threshold wins only where its error counts are large enough
#: to repeat on the counted half (at 0.95 the choice chases lucky tails: measured in
#: docs/results/privacy.md, "DP audit")
SELECT_CONFIDENCE = 0.999


def split_bound(neg: np.ndarray, pos: np.ndarray, delta: float = 0.0,
                confidence: float = 0.95) -> dict:
    """The lower bound of a distinguishing game from its scores (larger score: D').

    The threshold is chosen on the first half of each side's trials and the errors are
    counted on the second half only, so the counts are binomial with the threshold fixed
    and the Clopper-Pearson bound holds with ``confidence`` (choosing on the same trials
    that are counted would overstate the bound)."""
    neg, pos = np.asarray(neg, dtype=np.float64), np.asarray(pos, dtype=np.float64)
    if len(neg) < 2 or len(pos) < 2:
        raise ValueError("need at least 2 trials on each side")
    h0, h1 = len(neg) // 2, len(pos) // 2
    threshold, _ = choose_threshold(neg[:h0], pos[:h1], delta,
                                    max(confidence, SELECT_CONFIDENCE))
    fp, fn = errors_at(neg[h0:], pos[h1:], np.array([threshold]))
    eps = epsilon_lower_bound(int(fp[0]), len(neg) - h0, int(fn[0]), len(pos) - h1, delta,
                              confidence)
    return {"threshold": threshold, "false_pos": int(fp[0]), "negatives": len(neg) - h0,
            "false_neg": int(fn[0]), "positives": len(pos) - h1, "eps_lower": eps}


# ---- one run, many canaries (Steinke, Nasr and Jagielski, NeurIPS 2023) -----------------------

def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Probability, under an (eps, delta)-DP mechanism, that a guesser who made ``r`` guesses
    about ``m`` canaries (each included independently with probability 1/2) gets at least
    ``v`` right: ``P[Bin(r, q) >= v] + 2 m delta max_i P[v > Bin(r, q) >= v - i] / i``
    with ``q = e^eps / (1 + e^eps)``, the accuracy of eps-DP randomised response (their
    Theorem 5.2). With delta = 0 the count of right guesses is dominated by Bin(r, q)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    q = 1.0 / (1.0 + math.exp(-eps))
    tail = float(binom.sf(v - 1, r, q))                 # P[Bin(r, q) >= v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    below = binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Bin = v-1], P[Bin = v-2], ...
    worst = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * worst)


def one_run_epsilon(m: int, r: int, v: int, delta: float = 0.0,
                    confidence: float = 0.95) -> float:
    """The largest epsilon that ``v`` right guesses of ``r`` (``m`` canaries) refute at
    ``confidence``: the sup of eps with ``one_run_p_value <= 1 - confidence`` (bisection
    to 1e-6; 0 when even eps = 0 is not refuted)."""
    alpha = 1 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) > alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= alpha:  # the p-value grows with eps
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return lo
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) <= alpha else (lo, mid)
    return lo
