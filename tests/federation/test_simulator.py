"""federation/simulator.py: client selection (the round loop itself: test_round_engine.py)."""

from __future__ import annotations

import torch

from privfedcal.federation.local import make_generator
from privfedcal.federation.simulator import select_clients
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.settings.run_config import RunConfig


def _cfg(**kw):
    return RunConfig.of(**{"dataset": "digits", "clients": 10, "seed": 0, **kw})


def test_select_clients_is_a_seeded_permutation_of_the_public_config():
    cfg = _cfg(participation=0.3)
    # round(0.3 * 10) = 3 clients: the first three of a permutation seeded by (seed, round)
    ref = sorted(torch.randperm(10, generator=make_generator(0, 1, 0, 3))[:3].tolist())
    assert select_clients(PrivacyOptions.of(cfg), 1) == ref == [1, 2, 6]
    assert select_clients(PrivacyOptions.of(cfg), 2) == [0, 7, 8]
    assert select_clients(PrivacyOptions.of(cfg), 1) == select_clients(PrivacyOptions.of(_cfg(participation=0.3)), 1)
    seed1 = _cfg(participation=0.3, seed=1)
    assert [select_clients(PrivacyOptions.of(seed1), r) for r in range(1, 6)] != \
        [select_clients(PrivacyOptions.of(cfg), r) for r in range(1, 6)]


def test_full_and_tiny_participation():
    assert select_clients(PrivacyOptions.of(_cfg(participation=1.0)), 5) == list(range(10))
    assert len(select_clients(PrivacyOptions.of(_cfg(participation=0.01)), 1)) == 1  # at least one client
    assert len(select_clients(PrivacyOptions.of(_cfg(participation=0.55)), 1)) == 6  # round(5.5) = 6
