"""Empirical lower bounds on epsilon from a distinguishing game (Jagielski et al. 2020).

A distinguisher guesses, from one release, whether it came from dataset D or its neighbour
D'. If the release is (epsilon, delta)-DP, every distinguisher's false-positive rate FPR and
false-negative rate FNR satisfy ``FPR + e^eps FNR >= 1 - delta`` and
``FNR + e^eps FPR >= 1 - delta`` (Kairouz et al. 2015). Upper confidence bounds on both
rates (Clopper-Pearson, each at ``1 - (1 - confidence) / 2`` so that both hold together)
turn observed error counts into a lower bound on epsilon that holds with ``confidence``.
A bound above the claimed epsilon means the claim is false (with that confidence); a bound
below it proves nothing about the claim.
"""

from __future__ import annotations

import math

from scipy.stats import beta


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
