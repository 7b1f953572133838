"""Which samples of a client a per-class draw keeps: content keys and the per-class cap.

A key is a function of one sample's bytes and a public seed, never of the sample's position
or of the other samples, so that one example added to or removed from a client changes the
kept set by at most one swap (docs/threat-model.md, "Neighbours and sensitivities"). CReFF's client task
(``creff.GradTask``) keeps the ``cap`` samples of each class with the smallest keys, and
groups them for its augmentation by the key's low part.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: a Mersenne prime: products of two residues fit in int64, so the hash below is exact
HASH_PRIME = 2**31 - 1


def content_keys(x: Tensor, seed: int) -> Tensor:
    """An int64 key per sample that depends on the sample's bytes and ``seed`` only, never
    on its position or on the other samples: two seeded affine hashes modulo a prime of the
    sample's 32-bit words (``a0 + sum_j a_j w_j mod p``, a 2-universal family), combined into
    one key. Integer arithmetic makes it exact, so removing one sample leaves every other
    key unchanged bit for bit (a float projection is not: BLAS sums rows of different
    matrices in different orders)."""
    flat = x.detach().flatten(1).contiguous()
    if flat.is_floating_point() and flat.element_size() in (4, 8):
        words = flat.view(torch.int32)
    elif flat.is_floating_point():
        words = flat.view(torch.int16)
    else:
        words = flat
    g = torch.Generator().manual_seed(seed)
    coef = torch.randint(1, HASH_PRIME, (2, words.shape[1] + 1), generator=g).to(words.device)
    out = torch.empty(len(x), dtype=torch.int64, device=words.device)
    step = max(1, (1 << 22) // max(1, words.shape[1]))   # bounds the int64 block in memory
    for i in range(0, len(x), step):
        w = torch.remainder(words[i:i + step].to(torch.int64), HASH_PRIME)
        h = [(coef[k, 0] + torch.remainder(w * coef[k, 1:], HASH_PRIME).sum(1)) % HASH_PRIME
             for k in range(2)]
        out[i:i + step] = h[0] * HASH_PRIME + h[1]
    return out.cpu()


def capped_per_class(x: Tensor, y: Tensor, num_classes: int, cap: int,
                     seed: int) -> Tensor | None:
    """Sorted indices of at most ``cap`` samples per class: those with the smallest
    ``content_keys`` (a draw without replacement, uniform over seeds); None when no
    class has more than ``cap`` samples. A neighbouring dataset (one sample added or
    removed) changes the kept set by at most one swap."""
    y = y.detach().to("cpu", torch.long)
    if not bool((torch.bincount(y, minlength=num_classes) > cap).any()):
        return None
    return keep_smallest(content_keys(x, seed), y, num_classes, cap)


def keep_smallest(keys: Tensor, y: Tensor, num_classes: int, cap: int) -> Tensor | None:
    """Sorted indices of the ``cap`` smallest ``keys`` of every class (None: none over)."""
    y = y.detach().to("cpu", torch.long)
    counts = torch.bincount(y, minlength=num_classes)
    if not bool((counts > cap).any()):
        return None
    order = torch.argsort(keys, stable=True)                      # a random order ...
    order = order[torch.argsort(y[order], stable=True)]           # ... grouped by class
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(y)) - starts[y[order]]
    return torch.sort(order[rank < cap]).values
