"""Class-set and count inference from per-client payloads."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2, norm

from privfedcal.attacks.reconstruction.class_inference import (
    COUNT,
    INDICATOR,
    ROWS,
    TRACE,
    count_lower_bound,
    infer_classes,
    key_tests,
    score_class_sets,
)
from privfedcal.calibration.ccvr import CCVR
from privfedcal.calibration.creff import CReFF
from privfedcal.errors import UsageError
from privfedcal.privacy.releases import ReleaseSpec

C, D = 5, 4
TRUE_COUNTS = torch.tensor([3.0, 0.0, 1.0, 0.0, 2.0])
#: each key's presence test, as the calibrators' declarations give it (checked below)
CCVR_TESTS = {"count": COUNT, "sum": ROWS, "outer": TRACE}
CREFF_TESTS = {"grad": ROWS, "count": COUNT, "holders": INDICATOR}


def test_presence_tests_come_from_the_release_declarations():
    (ccvr,), (creff,) = CCVR.releases, CReFF.releases
    assert key_tests(ccvr) == CCVR_TESTS and key_tests(creff) == CREFF_TESTS
    # keys no calibrator names: the test follows the declared sensitivity, bound and symmetry
    toy = ReleaseSpec("toy", sensitivity={"a": "1", "b": "1", "c": "R^2", "d": "R"},
                      magnitude={"a": "N", "b": "K", "c": "R^2*N", "d": "R*N"},
                      symmetric=frozenset({"c"}))
    assert key_tests(toy) == {"a": COUNT, "b": INDICATOR, "c": TRACE, "d": ROWS}


def _ccvr_payload(seed: int = 0) -> dict[str, torch.Tensor]:
    """Sums over real features, as a client computes them: count, sum z, sum z z^T."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.repeat_interleave(torch.arange(C), TRUE_COUNTS.long())
    z = torch.randn(labels.numel(), D, generator=g, dtype=torch.float64) + 2.0
    onehot = torch.nn.functional.one_hot(labels, C).double()
    return {
        "count": onehot.sum(0),
        "sum": onehot.T @ z,
        "outer": torch.einsum("nc,nd,ne->cde", onehot, z, z),
    }


def test_plaintext_counts_exact():
    pred = infer_classes(_ccvr_payload(), tests=CCVR_TESTS)
    assert pred[0].tolist() == [True, False, True, False, True]
    assert torch.equal(pred[1], TRUE_COUNTS)
    assert score_class_sets(pred, TRUE_COUNTS) == {
        "accuracy": 1.0,
        "precision": 1.0,
        "recall": 1.0,
        "count_mae": 0.0,
    }


def test_hidden_counts_presence_from_rows_and_count_bound():
    p = _ccvr_payload()
    hidden = {"sum": p["sum"], "outer": p["outer"]}
    present, counts = infer_classes(hidden, tests=CCVR_TESTS)
    assert present.tolist() == (TRUE_COUNTS > 0).tolist() and counts is None
    bound = count_lower_bound(hidden["sum"], hidden["outer"])
    assert (bound <= TRUE_COUNTS).all() and (bound[TRUE_COUNTS > 0] >= 1).all()
    # identical features in a class make the Cauchy-Schwarz bound tight
    z = torch.tensor([1.0, 2.0, 0.5, 0.0], dtype=torch.float64)
    tight = {"sum": (3 * z)[None], "outer": (3 * torch.outer(z, z))[None]}
    assert count_lower_bound(tight["sum"], tight["outer"]).tolist() == [3.0]


def test_creff_payload_with_holders_and_batched_clients():
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(2, C, C, D + 1, generator=g)  # two clients
    holders = torch.tensor([[1.0, 0, 1, 0, 0], [0, 1, 1, 1, 0]])
    grad = grad * holders[..., None, None]  # absent classes upload zero blocks
    present, counts = infer_classes({"grad": grad, "holders": holders}, tests=CREFF_TESTS,
                                    leading=1)
    assert present.tolist() == (holders > 0).tolist() and counts is None
    present_g, _ = infer_classes({"grad": grad}, tests=CREFF_TESTS, leading=1)
    assert torch.equal(present_g, present)


def test_noised_payload_thresholds_follow_the_noise_level():
    sigma, alpha, keys = 0.1, 1e-3, 3
    p = _ccvr_payload()
    g = torch.Generator().manual_seed(3)
    noisy = {k: v + sigma * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in p.items()}
    present, counts = infer_classes(noisy, tests=CCVR_TESTS, noise_std=sigma, false_positive_rate=alpha)
    assert present.tolist() == (TRUE_COUNTS > 0).tolist()
    assert torch.equal(counts, TRUE_COUNTS)
    # pin the sum test: ||row||^2 / sigma^2 against chi2_{1 - alpha / keys}(D)
    thr = sigma * math.sqrt(chi2.ppf(1 - alpha / keys, D))
    z_thr = norm.ppf(1 - alpha / keys)
    quiet = {
        "count": torch.zeros(2),
        "outer": torch.zeros(2, D, D),
        "sum": torch.stack([torch.full((D,), 0.99 * thr / 2), torch.full((D,), 1.01 * thr / 2)]),
    }
    assert infer_classes(quiet, tests=CCVR_TESTS, noise_std=sigma, false_positive_rate=alpha)[0].tolist() == [
        False,
        True,
    ]
    # and the one-sided count test: count / sigma against z_{1 - alpha / keys}
    loud = dict(quiet, sum=torch.zeros(2, D), count=torch.tensor([0.99, 1.01]) * sigma * z_thr)
    assert infer_classes(loud, tests=CCVR_TESTS, noise_std=sigma, false_positive_rate=alpha)[0].tolist() == [
        False,
        True,
    ]


def test_per_key_noise_levels_must_cover_the_payload():
    p = _ccvr_payload()
    with pytest.raises(UsageError):
        infer_classes(p, tests=CCVR_TESTS, noise_std={"count": 1.0, "sum": 1.0})
    present, _ = infer_classes(p, tests=CCVR_TESTS,
                               noise_std={"count": 0.5, "sum": 0.5, "outer": 0.5})
    assert present.tolist() == (TRUE_COUNTS > 0).tolist()
    with pytest.raises(UsageError):
        infer_classes({"weights": torch.zeros(3)}, tests=CCVR_TESTS)


def test_score_hand_values():
    truth = torch.tensor([2.0, 0.0, 1.0, 0.0])
    present = torch.tensor([True, True, False, False])
    counts = torch.tensor([3.0, 1.0, 0.0, 0.0])
    s = score_class_sets((present, counts), truth)
    # tp = 1 (class 0), predicted 2, held 2; correct entries: 0 and 3 -> 2/4
    assert s["accuracy"] == 0.5 and s["precision"] == 0.5 and s["recall"] == 0.5
    assert s["count_mae"] == pytest.approx((1 + 1 + 1 + 0) / 4)
    assert math.isnan(score_class_sets((present, None), truth)["count_mae"])
