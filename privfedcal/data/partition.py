"""Client partitions of a training set: iid, Dirichlet label skew, long tail, shards, domains.

- ``dirichlet`` (label skew, the procedure of the MOON/CCVR/NIID-Bench code, docs/methods.md
  "Partitions"): for every class i, shuffle its indices, draw ``p_i ~ Dir_K(alpha)`` and
  cut the class at ``floor(cumsum(p_i) * n_i)``. As in that code, a client that already holds
  ``>= N/K`` samples gets no share of later classes (its ``p_{i,k}`` is zeroed and the rest
  renormalised), which keeps client sizes from exploding at small alpha. The whole draw is
  repeated while a client holds fewer than ``min_size`` samples (at most ``1 + max_retries``
  draws, then UsageError); ``min_size`` defaults to 10, as MOON's and NIID-Bench's code.
- ``longtail`` (CReFF, after Cao et al. 2019): keep ``n_c = floor(n_max * IF^(-r/(C-1)))``
  random samples of the class of size rank r (classes sorted by size descending, ties by
  class id; capped at the class's size), then federate the kept samples as CReFF's authors'
  code does (the setting of the paper's tables, docs/methods.md): shuffle them, cut them into
  blocks of 10 clients (``floor(10 N / K)`` samples each, the last block takes the rest and
  ``K - 10 (B - 1)`` clients), run the capped Dirichlet draw above inside every block and
  re-draw the block until each of its clients holds at least ``floor(N_b / (2 K_b))``
  samples (half the block's mean), then concatenate the block clients in order (each client
  class by class) and re-cut that sequence into K consecutive equal-size clients (the first
  ``N mod K`` one larger). Samples not kept belong to no client: every *kept* sample lands on
  exactly one client.
- ``longtail-dirichlet``: the paper text's procedure, the same kept samples split by
  ``dirichlet`` directly (client sizes vary).
- ``iid``: a shuffled split into K parts whose sizes differ by at most one.
- ``shards`` (FedAvg): sort by label (stable), cut into ``K * shards_per_client`` near-equal
  shards, deal ``shards_per_client`` random shards to every client.
- ``domains`` (feature shift, FedUV): client k holds the domain with the k-th smallest id.
- ``natural`` (real users, as LEAF's FEMNIST): the data give every training sample a user id;
  client k holds the user with the k-th smallest id. Nothing is drawn (``seed`` is unused),
  ``num_clients`` must equal the number of distinct ids, and a user below ``min_size`` is
  refused by id, never dropped (docs/usage.md, "Natural partitions").

Every scheme returns sorted int64 index arrays, is deterministic for ``seed`` and, for all
schemes but ``longtail``, puts every training index on exactly one client. Every scheme
refuses (UsageError) a result where a client has fewer than ``min_size`` samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from privfedcal.errors import UsageError
from privfedcal.settings.messages import SettingError

if TYPE_CHECKING:
    from privfedcal.data.datasets import Dataset

PARTITIONS = ("iid", "dirichlet", "longtail", "longtail-dirichlet", "shards", "domains",
              "natural")
CREFF_BLOCK = 10  # clients per block of CReFF's long-tail federation draw


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """How to split a training set over ``num_clients`` clients."""

    scheme: str = "dirichlet"
    num_clients: int = 10
    alpha: float = 0.1
    imbalance_factor: float = 1.0
    shards_per_client: int = 2
    min_size: int = 10
    max_retries: int = 1000

    def __post_init__(self) -> None:
        if self.scheme not in PARTITIONS:
            raise UsageError(f"unknown partition {self.scheme!r}; valid choices: {', '.join(PARTITIONS)}")
        if not _is_int(self.num_clients) or self.num_clients < 1:
            raise UsageError(f"clients must be a positive integer, got {self.num_clients}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise UsageError(f"alpha must be a finite number > 0, got {self.alpha}")
        if not (math.isfinite(self.imbalance_factor) and self.imbalance_factor >= 1):
            raise UsageError(f"imbalance factor must be >= 1 (1 = no long tail), got {self.imbalance_factor}")
        if not _is_int(self.shards_per_client) or self.shards_per_client < 1:
            raise UsageError(f"shards per client must be a positive integer, got {self.shards_per_client}")
        if not _is_int(self.min_size) or self.min_size < 0:
            raise UsageError(f"min size must be an integer >= 0, got {self.min_size}")
        if not _is_int(self.max_retries) or self.max_retries < 0:
            raise UsageError(f"max retries must be an integer >= 0, got {self.max_retries}")


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def partition_indices(labels: np.ndarray, spec: PartitionSpec, seed: int,
                      domains: np.ndarray | None = None,
                      users: np.ndarray | None = None) -> list[np.ndarray]:
    """Indices of ``labels`` held by each of ``spec.num_clients`` clients (sorted, int64);
    ``domains`` and ``users`` are per-sample ids the ``domains`` and ``natural`` schemes read."""
    labels = _labels(labels)
    if not _is_int(seed) or seed < 0:
        raise UsageError(f"seed must be an integer >= 0, got {seed}")
    if spec.num_clients > len(labels) and spec.scheme != "natural":  # natural names the users
        raise UsageError(f"{spec.num_clients} clients but only {len(labels)} training samples")
    if spec.scheme == "domains":
        parts = _domains(labels, spec, domains)
    elif spec.scheme == "natural":
        parts = _natural(labels, spec, users)
    else:
        parts = _SCHEMES[spec.scheme](labels, spec, np.random.default_rng(seed), seed)
    small = min(len(p) for p in parts)
    if small < spec.min_size:
        raise UsageError(f"{spec.scheme} partition gives a client {small} samples, fewer than "
                         f"min size {spec.min_size}; use fewer clients")
    return parts


def _labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise UsageError("labels must be a non-empty 1-D integer array")
    if labels.min() < 0:
        raise UsageError("labels must be >= 0")
    return labels.astype(np.int64, copy=False)


def _split_by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Client k's sorted indices from an owner id per sample (-1 = nobody)."""
    order = np.argsort(owner, kind="stable")  # stable: indices stay ascending within a client
    sizes = np.bincount(owner[owner >= 0], minlength=num_clients)
    start = int(np.count_nonzero(owner < 0))  # the unowned sort first (-1)
    return [p.astype(np.int64) for p in np.split(order[start:], np.cumsum(sizes)[:-1])]


def _iid(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator, _seed: int) -> list[np.ndarray]:
    return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(len(labels)), spec.num_clients)]


def _dirichlet_owner(labels: np.ndarray, pool: np.ndarray, spec: PartitionSpec,
                     rng: np.random.Generator) -> np.ndarray:
    """Owner id per sample; samples outside ``pool`` keep -1."""
    k, n = spec.num_clients, len(pool)
    if n < k * spec.min_size:
        raise UsageError(f"{n} samples cannot give each of {k} clients min size {spec.min_size}")
    pool_labels = labels[pool]
    classes = np.unique(pool_labels)
    for _ in range(1 + spec.max_retries):
        owner = np.full(len(labels), -1, dtype=np.int64)
        sizes = np.zeros(k, dtype=np.int64)
        for c in classes:
            idx = rng.permutation(pool[pool_labels == c])
            p = rng.dirichlet(np.full(k, spec.alpha))
            capped = p * (sizes < n / k)
            p = capped / capped.sum() if capped.sum() > 0 else p
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            counts = np.diff(np.concatenate(([0], cuts, [len(idx)])))
            owner[idx] = np.repeat(np.arange(k), counts)
            sizes += counts
        if sizes.min() >= spec.min_size:
            return owner
    raise UsageError(f"dirichlet partition cannot give each of {k} clients {spec.min_size} samples "
                     f"in {1 + spec.max_retries} draws; use a larger alpha or fewer clients")


def _dirichlet(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator, _seed: int) -> list[np.ndarray]:
    owner = _dirichlet_owner(labels, np.arange(len(labels)), spec, rng)
    return _split_by_owner(owner, spec.num_clients)


def longtail_counts(class_sizes: np.ndarray, imbalance_factor: float) -> np.ndarray:
    """Samples kept per class id: ``floor(n_max * (1/IF)^(r/(C-1)))`` for size rank r.

    Classes absent from the data (size 0) take no rank and keep 0.
    """
    sizes = np.asarray(class_sizes, dtype=np.int64)
    present = np.flatnonzero(sizes > 0)
    rank_order = present[np.lexsort((present, -sizes[present]))]  # size desc, ties by id
    keep = np.zeros(len(sizes), dtype=np.int64)
    n_max, c = int(sizes.max()), len(present)
    for r, cls in enumerate(rank_order):
        # Cao et al.'s expression, term for term, so CIFAR-10-LT counts match theirs exactly.
        target = int(n_max * (1.0 / imbalance_factor) ** (r / (c - 1.0))) if c > 1 else n_max
        keep[cls] = min(target, int(sizes[cls]))
    return keep


def longtail_subset(labels: np.ndarray, imbalance_factor: float, seed: int) -> np.ndarray:
    """Sorted int64 indices kept by the long-tail shaping (random within each class)."""
    labels = _labels(labels)
    if not (math.isfinite(imbalance_factor) and imbalance_factor >= 1):
        raise UsageError(f"imbalance factor must be >= 1, got {imbalance_factor}")
    rng = np.random.default_rng(seed)
    keep = longtail_counts(np.bincount(labels), imbalance_factor)
    kept = [rng.permutation(np.flatnonzero(labels == c))[: keep[c]] for c in np.flatnonzero(keep)]
    return np.sort(np.concatenate(kept)).astype(np.int64)


def _longtail_dirichlet(labels: np.ndarray, spec: PartitionSpec, _rng: np.random.Generator,
                        seed: int) -> list[np.ndarray]:
    pool = longtail_subset(labels, spec.imbalance_factor, seed)
    # A stream of its own, so the Dirichlet draws are not correlated with the subset's.
    owner = _dirichlet_owner(labels, pool, spec, np.random.default_rng([seed, 1]))
    return _split_by_owner(owner, spec.num_clients)


def creff_block_clients(labels: np.ndarray, pool: np.ndarray, spec: PartitionSpec,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """The block clients of CReFF's long-tail federation draw, before the equal-size re-cut
    (each client's indices class by class, in the shuffled order)."""
    k, n = spec.num_clients, len(pool)
    shuffled = rng.permutation(pool)
    num_blocks = math.ceil(k / CREFF_BLOCK)
    step = int(CREFF_BLOCK / k * n)
    classes = np.unique(labels[pool])
    clients: list[np.ndarray] = []
    for i in range(num_blocks):
        block = shuffled[i * step: n if i == num_blocks - 1 else (i + 1) * step]
        kb = CREFF_BLOCK if i < num_blocks - 1 else k - CREFF_BLOCK * (num_blocks - 1)
        need = int(0.5 * len(block) / kb)
        block_labels = labels[block]
        for _ in range(1 + spec.max_retries):
            parts: list[list[np.ndarray]] = [[] for _ in range(kb)]
            sizes = np.zeros(kb, dtype=np.int64)
            for c in classes:
                idx = block[block_labels == c]
                p = rng.dirichlet(np.full(kb, spec.alpha))
                capped = p * (sizes < len(block) / kb)
                p = capped / capped.sum() if capped.sum() > 0 else p
                cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
                for j, piece in enumerate(np.split(idx, cuts)):
                    parts[j].append(piece)
                    sizes[j] += len(piece)
            if sizes.min() >= need:
                break
        else:
            raise SettingError("longtail partition: a block of {kb} clients found no draw giving "
                               "each at least {need} samples in {draws} draws; use a larger "
                               "alpha, or {partition=}", kb=kb, need=need,
                               draws=1 + spec.max_retries, partition="longtail-dirichlet")
        clients += [np.concatenate(p).astype(np.int64) for p in parts]
    return clients


def _longtail(labels: np.ndarray, spec: PartitionSpec, _rng: np.random.Generator, seed: int) -> list[np.ndarray]:
    pool = longtail_subset(labels, spec.imbalance_factor, seed)
    blocks = creff_block_clients(labels, pool, spec, np.random.default_rng([seed, 1]))
    flat = np.concatenate(blocks)
    base, extra = divmod(len(flat), spec.num_clients)
    sizes = [base + 1 if i < extra else base for i in range(spec.num_clients)]
    return [np.sort(p) for p in np.split(flat, np.cumsum(sizes)[:-1])]


def _shards(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator, _seed: int) -> list[np.ndarray]:
    num_shards = spec.num_clients * spec.shards_per_client
    if num_shards > len(labels):
        raise UsageError(f"{num_shards} shards ({spec.num_clients} clients x {spec.shards_per_client}) "
                         f"but only {len(labels)} samples")
    shards = np.array_split(np.argsort(labels, kind="stable"), num_shards)
    deal = rng.permutation(num_shards).reshape(spec.num_clients, spec.shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])).astype(np.int64) for row in deal]


def _domains(labels: np.ndarray, spec: PartitionSpec, domains: np.ndarray | None) -> list[np.ndarray]:
    if domains is None:
        raise UsageError("the domains partition needs a dataset with domain folders "
                         "(imagefolder:PATH with PATH/<domain>/<class>/ images)")
    domains = np.asarray(domains)
    if domains.shape != labels.shape or not np.issubdtype(domains.dtype, np.integer):
        raise UsageError("domains must be one integer domain id per training sample")
    ids = np.unique(domains)
    if len(ids) != spec.num_clients:
        raise UsageError(f"the domains partition has one client per domain: set clients to "
                         f"{len(ids)}, not {spec.num_clients}")
    return [np.flatnonzero(domains == d).astype(np.int64) for d in ids]


def _natural(labels: np.ndarray, spec: PartitionSpec, users: np.ndarray | None) -> list[np.ndarray]:
    if users is None:
        raise UsageError("the natural partition needs a user id per training sample: a 'users' "
                         "array in npz:PATH (one per x_train row) or user folders in "
                         "imagefolder:PATH (PATH/train/<user>/<class>/ or PATH/<user>/<class>/)")
    users = np.asarray(users)
    if users.shape != labels.shape or not np.issubdtype(users.dtype, np.integer):
        raise UsageError("users must be one integer user id per training sample")
    ids, owner = np.unique(users, return_inverse=True)
    if len(ids) != spec.num_clients:
        raise UsageError(f"the natural partition has one client per user: the data hold "
                         f"{len(ids)} users, so set clients to {len(ids)}, not {spec.num_clients}")
    sizes = np.bincount(owner, minlength=len(ids))
    k = int(sizes.argmin())
    if sizes[k] < spec.min_size:
        raise UsageError(f"natural partition: user {int(ids[k])} (client {k}) holds {int(sizes[k])} "
                         f"training samples, fewer than min size {spec.min_size}; lower the min "
                         "size or leave users that small out of the data")
    return _split_by_owner(owner.astype(np.int64), len(ids))


def partition_dataset(data: Dataset, spec: PartitionSpec, seed: int) -> list[np.ndarray]:
    """``partition_indices`` of a Dataset's training labels, with its domain and user ids."""
    def ids(t: object) -> np.ndarray | None:
        return None if t is None else t.cpu().numpy()  # type: ignore[attr-defined]

    return partition_indices(data.y_train.cpu().numpy(), spec, seed,
                             domains=ids(data.domains_train), users=ids(data.users_train))


def client_sources(data: Dataset, scheme: str) -> dict[str, list[str]]:
    """What each client is, for the experimenter's partition records: ``client_domains``
    (``domains``) or ``client_users`` (``natural``: the user names, or ids, in client order).
    Private: the user-to-client map never leaves the clients' side (docs/threat-model.md)."""
    if scheme == "domains" and data.domain_names is not None:
        return {"client_domains": list(data.domain_names)}
    if scheme == "natural" and data.users_train is not None:
        ids = np.unique(data.users_train.cpu().numpy())
        names = data.user_names
        return {"client_users": [names[i] if names else str(i) for i in ids.tolist()]}
    return {}


_SCHEMES: dict[str, Callable[[np.ndarray, PartitionSpec, np.random.Generator, int], list[np.ndarray]]] = {
    "iid": _iid, "dirichlet": _dirichlet, "longtail": _longtail,
    "longtail-dirichlet": _longtail_dirichlet, "shards": _shards,
}


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(K, C) int64: samples of class c held by client k."""
    labels = _labels(labels)
    if labels.max() >= num_classes:
        raise UsageError(f"label {int(labels.max())} out of range for {num_classes} classes")
    if not parts:
        return np.zeros((0, num_classes), dtype=np.int64)
    owner = np.concatenate([np.full(len(p), k) for k, p in enumerate(parts)])
    flat = owner * num_classes + labels[np.concatenate(parts).astype(np.int64)]
    return np.bincount(flat, minlength=len(parts) * num_classes).reshape(len(parts), num_classes)
