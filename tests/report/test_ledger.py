"""The release ledger's 'epsilon spent so far' is the composition of every release up to the
row, computed by opacus's RDP accountant directly here."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import RDPAccountant

from privfedcal.report.run_report import ledger, worst_class


def opacus_epsilon(history, delta):
    acc = RDPAccountant()
    acc.history = [(z, q, t) for z, q, t in history]
    return acc.get_epsilon(delta)


def test_cumulative_epsilon_matches_opacus():
    releases = [{"label": "creff-grad", "noise_multiplier": 2.0, "sample_rate": 0.5, "steps": 3},
                {"label": "dp-sgd", "noise_multiplier": 1.1, "sample_rate": 0.1, "steps": 20}]
    rows = ledger({"accountant": "rdp", "delta": 1e-5, "releases": releases})
    first = opacus_epsilon([(2.0, 0.5, 3)], 1e-5)
    both = opacus_epsilon([(2.0, 0.5, 3), (1.1, 0.1, 20)], 1e-5)
    assert rows[0]["epsilon_spent"] == pytest.approx(first, rel=1e-6)
    assert rows[1]["epsilon_spent"] == pytest.approx(both, rel=1e-6)
    assert both > first  # composition only adds


def test_recorded_epsilon_wins_and_missing_accountant_is_empty():
    rows = ledger({"releases": [{"label": "x", "noise_multiplier": 1.0, "epsilon_spent": 3.0}]})
    assert rows[0]["epsilon_spent"] == 3.0
    assert ledger({}) == []


def test_worst_class_skips_classes_without_samples():
    assert worst_class({"per_class_accuracy": [0.5, None, 0.25, 0.9]}) == (2, 0.25)
    assert worst_class({"per_class_accuracy": [None]}) is None
    assert not math.isnan(worst_class({"per_class_accuracy": [0.0]})[1])
