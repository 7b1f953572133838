"""Where DP noise comes from: the operating system's entropy, never the run seed.

The run seed is public (``config.json``, the Flower run config): noise drawn from a generator
seeded by it can be regenerated and subtracted by anyone holding the run folder, which
cancels the guarantee completely. Every DP draw (client noise of the uploads, the key
holder's top-up and decryption flooding, DP-SGD's Poisson batches and gradient noise) takes a
fresh generator from ``noise_generator``: a torch generator seeded with 64 bits of
``secrets`` (``os.urandom``), drawn anew for every release and client, so no party other than
the one drawing can reproduce it and two runs with the same seed draw different noise.

Reproducible noise exists for tests and benchmarks only, behind ``--insecure-seeded-noise``
(``seeded=True`` here): the generator then derives from (seed, purpose...) as before, the run
warns at start and ``summary.json`` says the guarantee does not hold against anyone who knows
the seed. Non-DP randomness (partitions, initialisation, client sampling, batch order without
DP) stays seeded, so a run without DP remains reproducible.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
from collections.abc import Callable

import torch

from privfedcal.seeding import derive_seed

log = logging.getLogger("privfedcal.noise")

#: what summary.json and the start-up warning say when noise is seeded
INSECURE_STATEMENT = ("INSECURE: --insecure-seeded-noise draws the DP noise from the public run "
                      "seed; the privacy guarantee does not hold against anyone who knows the "
                      "seed (config.json)")


def os_entropy_seed() -> int:
    """64 fresh bits from the operating system's CSPRNG (``secrets``)."""
    return secrets.randbits(64)


def noise_generator(*parts: int, seeded: bool = False,
                    device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for DP noise on ``device``: OS entropy, or (``seeded``, insecure) the
    generator of ``parts`` = (seed, round, client, purpose) for reproducible tests."""
    g = torch.Generator(device=device)
    if seeded:
        g.manual_seed(derive_seed(*parts))
    else:
        g.manual_seed(os_entropy_seed())
    return g


_DRAWER: concurrent.futures.ThreadPoolExecutor | None = None


def draw_in_background(draw: Callable[[], torch.Tensor]) -> concurrent.futures.Future:
    """``draw()`` on the noise thread (one for the process, started on first use): a draw
    that depends on no data runs beside the work that does (``UserDP.draw_ahead``). torch
    releases the interpreter lock while it draws."""
    global _DRAWER
    if _DRAWER is None:
        _DRAWER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="privfedcal-noise")
    return _DRAWER.submit(draw)


def warn_if_seeded(seeded: bool) -> None:
    if seeded:
        log.warning(INSECURE_STATEMENT)


__all__ = ["INSECURE_STATEMENT", "draw_in_background", "noise_generator", "os_entropy_seed", "warn_if_seeded"]
