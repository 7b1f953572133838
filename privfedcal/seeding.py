"""Seeds derived from the public run seed: every random draw of a run (partition, model
initialisation, client selection, batches) comes from a generator seeded by
(seed, round, client, purpose), so a run is reproducible and resumable from any round.
DP noise never comes from here (privacy/noise.py draws OS entropy)."""

from __future__ import annotations

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client, purpose), collision-resistant."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2,
               dtype=np.uint64)[0] >> np.uint64(1))


def make_generator(*parts: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(*parts))
    return g
