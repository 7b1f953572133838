"""Shared fixtures: tiny, fast, CPU-only, one thread (CI has 2 cores)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def tiny_cfg():
    """A RunConfig small enough for a unit test (digits, 4 clients, 2 rounds), with data seed
    0: a protected run's partition is the plain run's (it would be fresh OS entropy
    otherwise), so tests are repeatable; tests of the fresh data seed pass data_seed=None."""
    from privfedcal.settings.run_config import RunConfig

    def make(**kw):
        base = dict(dataset="digits", clients=4, alpha=0.5, rounds=2, local_epochs=1,
                    batch_size=32, device="cpu", threads=1, seed=0, data_seed=0,
                    transcript=False)
        base.update(kw)
        return RunConfig.of(**base)

    return make
