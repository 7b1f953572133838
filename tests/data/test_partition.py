"""Partitions: properties over random labels, golden long-tail counts, reference Dirichlet."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privfedcal.data.partition import (
    PartitionSpec,
    class_counts,
    longtail_counts,
    longtail_subset,
    partition_indices,
)
from privfedcal.errors import UsageError

FAST = settings(max_examples=40, deadline=None)
labels_st = st.lists(st.integers(0, 5), min_size=1, max_size=120).map(np.array)


def check_parts(parts: list[np.ndarray], n: int, spec: PartitionSpec, covering: bool = True) -> None:
    assert len(parts) == spec.num_clients
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0) and len(p) >= spec.min_size
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # disjoint
    assert flat.min() >= 0 and flat.max() < n
    if covering:
        assert len(flat) == n


@FAST
@given(labels=labels_st, k=st.integers(1, 12), alpha=st.floats(0.01, 10.0),
       scheme=st.sampled_from(["iid", "dirichlet", "shards"]), seed=st.integers(0, 2**31),
       min_size=st.integers(0, 4), spc=st.integers(1, 3))
def test_partitions_are_disjoint_covering_deterministic(labels, k, alpha, scheme, seed, min_size, spc):
    spec = PartitionSpec(scheme=scheme, num_clients=k, alpha=alpha, min_size=min_size,
                         shards_per_client=spc, max_retries=20)
    try:
        parts = partition_indices(labels, spec, seed)
    except UsageError as exc:
        # iid only fails when the numbers cannot work; say why in one line
        assert "\n" not in str(exc)
        if scheme == "iid":
            assert k > len(labels) or len(labels) // k < min_size
        return
    check_parts(parts, len(labels), spec)
    again = partition_indices(labels, spec, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    if scheme == "iid":
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def reference_dirichlet(labels: np.ndarray, k: int, alpha: float, min_size: int,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """The MOON/NIID-Bench loop, written with Python lists as in that code."""
    n = len(labels)
    size = 0
    while size < min_size:
        batches: list[list[int]] = [[] for _ in range(k)]
        for c in np.unique(labels):
            idx = rng.permutation(np.where(labels == c)[0])
            p = rng.dirichlet(np.repeat(alpha, k))
            p = np.array([pj * (len(bj) < n / k) for pj, bj in zip(p, batches, strict=True)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            batches = [bj + part.tolist() for bj, part in zip(batches, np.split(idx, cuts), strict=True)]
        size = min(len(bj) for bj in batches)
    return [np.sort(np.array(bj, dtype=np.int64)) for bj in batches]


@pytest.mark.parametrize("alpha, k, seed", [(0.5, 5, 0), (0.1, 10, 3), (5.0, 4, 7)])
def test_dirichlet_matches_reference_loop(alpha, k, seed):
    labels = np.random.default_rng(99).integers(0, 10, size=600)
    spec = PartitionSpec(scheme="dirichlet", num_clients=k, alpha=alpha, min_size=10)
    ours = partition_indices(labels, spec, seed)
    ref = reference_dirichlet(labels, k, alpha, 10, np.random.default_rng(seed))
    assert all(np.array_equal(a, b) for a, b in zip(ours, ref, strict=True))


def test_dirichlet_alpha_controls_skew():
    labels = np.repeat(np.arange(10), 200)
    skew = {}
    for alpha in (0.05, 100.0):
        parts = partition_indices(labels, PartitionSpec(num_clients=5, alpha=alpha), 0)
        counts = class_counts(labels, parts, 10)
        skew[alpha] = (counts > 0).sum(axis=1).mean()  # classes held per client
        check_parts(parts, len(labels), PartitionSpec(num_clients=5))
    assert skew[100.0] == 10 and skew[0.05] < 5


def test_dirichlet_gives_up_with_usage_error():
    labels = np.zeros(30, dtype=np.int64)  # one class: a tiny alpha puts it all on one client
    spec = PartitionSpec(num_clients=10, alpha=1e-3, min_size=2, max_retries=5)
    with pytest.raises(UsageError, match="larger alpha or fewer clients"):
        partition_indices(labels, spec, 0)
    with pytest.raises(UsageError, match="cannot give each"):
        partition_indices(labels, PartitionSpec(num_clients=10, min_size=4), 0)


def test_longtail_counts_golden():
    # CIFAR-10-LT (Cao et al. 2019): 5000 per class, IF = 100 -> 12406 images; IF = 10 -> 20431
    cifar = np.full(10, 5000)
    keep = longtail_counts(cifar, 100.0)
    assert keep.tolist() == [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]
    assert longtail_counts(cifar, 10.0).sum() == 20431
    # Hand-computed: sizes [10, 30, 30, 5], IF 4 -> ranks: class 1 (30), 2 (30, tie by id), 0, 3
    # n_r = floor(30 * 4^(-r/3)) = 30, 18, 11, 7; capped at the sizes of classes 0 and 3
    assert longtail_counts(np.array([10, 30, 30, 5]), 4.0).tolist() == [10, 30, 18, 5]
    assert longtail_counts(np.array([7, 0, 3]), 1.0).tolist() == [7, 0, 3]


@FAST
@given(per_class=st.integers(5, 40), c=st.integers(2, 6), imbalance=st.floats(1.0, 50.0),
       seed=st.integers(0, 1000), k=st.integers(1, 4))
def test_longtail_partition_keeps_formula(per_class, c, imbalance, seed, k):
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(c), per_class))
    kept = longtail_subset(labels, imbalance, seed)
    expected = [int(per_class * (1.0 / imbalance) ** (r / (c - 1.0))) for r in range(c)]
    assert np.bincount(labels[kept], minlength=c).tolist() == expected
    for scheme in ("longtail", "longtail-dirichlet"):
        spec = PartitionSpec(scheme=scheme, num_clients=k, imbalance_factor=imbalance,
                             min_size=0, max_retries=3, alpha=1.0)
        try:
            parts = partition_indices(labels, spec, seed)
        except UsageError as exc:  # the block draw's half-mean rule can fail on tiny data
            assert scheme == "longtail" and "half" not in str(exc) and "\n" not in str(exc)
            continue
        check_parts(parts, len(labels), spec, covering=False)
        assert np.array_equal(np.sort(np.concatenate(parts)), kept)  # every kept sample, once
        if scheme == "longtail":  # re-cut into equal sizes, the first N mod K one larger
            sizes = [len(p) for p in parts]
            assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


@FAST
@given(per_class=st.integers(1, 30), c=st.integers(1, 8), k=st.integers(1, 6),
       spc=st.integers(1, 3), seed=st.integers(0, 1000))
def test_shards_hold_few_classes(per_class, c, k, spc, seed):
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(c), per_class))
    spec = PartitionSpec(scheme="shards", num_clients=k, shards_per_client=spc, min_size=0)
    if k * spc > len(labels):
        with pytest.raises(UsageError, match="shards|clients but only"):
            partition_indices(labels, spec, seed)
        return
    parts = partition_indices(labels, spec, seed)
    check_parts(parts, len(labels), spec)
    shard = len(labels) / (k * spc)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= spc * np.floor(shard) and sizes.max() <= spc * np.ceil(shard)
    if per_class >= np.ceil(shard):  # a shard then spans at most two classes
        assert ((class_counts(labels, parts, c) > 0).sum(axis=1) <= 2 * spc).all()


def test_domains_one_client_per_domain():
    labels = np.array([0, 1, 0, 1, 2, 2])
    domains = np.array([5, 5, 2, 2, 2, 9])
    parts = partition_indices(labels, PartitionSpec(scheme="domains", num_clients=3, min_size=1),
                              0, domains=domains)
    assert [p.tolist() for p in parts] == [[2, 3, 4], [0, 1], [5]]
    with pytest.raises(UsageError, match="set clients to 3"):
        partition_indices(labels, PartitionSpec(scheme="domains", num_clients=2), 0, domains=domains)
    with pytest.raises(UsageError, match="domain folders"):
        partition_indices(labels, PartitionSpec(scheme="domains", num_clients=3), 0)
    with pytest.raises(UsageError, match="fewer than min size"):  # domain 9 has one sample
        partition_indices(labels, PartitionSpec(scheme="domains", num_clients=3, min_size=2),
                          0, domains=domains)


@pytest.mark.parametrize("kwargs", [
    {"scheme": "pathological"}, {"alpha": 0.0}, {"alpha": float("nan")}, {"num_clients": 0},
    {"num_clients": 2.5}, {"imbalance_factor": 0.5}, {"shards_per_client": 0},
    {"min_size": -1}, {"max_retries": -1}, {"num_clients": True},
])
def test_bad_specs(kwargs):
    with pytest.raises(UsageError):
        PartitionSpec(**kwargs)


def test_bad_inputs():
    spec = PartitionSpec(num_clients=3)
    with pytest.raises(UsageError, match="3 clients but only 2"):
        partition_indices(np.array([0, 1]), spec, 0)
    for labels in (np.array([]), np.zeros((3, 2), int), np.array([0.5, 1.0]), np.array([-1, 0, 1])):
        with pytest.raises(UsageError, match="labels"):
            partition_indices(labels, spec, 0)
    with pytest.raises(UsageError, match="seed"):
        partition_indices(np.arange(9) % 3, spec, -1)
    with pytest.raises(UsageError, match="out of range"):
        class_counts(np.array([0, 4]), [np.array([0, 1])], 3)


def test_class_counts_against_loop():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=50)
    parts = partition_indices(labels, PartitionSpec(num_clients=3, alpha=0.5), 1)
    expected = np.array([[np.sum(labels[p] == c) for c in range(4)] for p in parts])
    np.testing.assert_array_equal(class_counts(labels, parts, 4), expected)


def reference_creff_blocks(labels, pool, k, alpha, rng):
    """CReFF's authors' long-tail federation loop, with Python lists as in that code (same
    draws from ``rng`` in the same order), and its equal-size re-cut."""
    pairs = list(rng.permutation(pool))
    n, auxi = len(pairs), 10
    splits = -(-k // auxi)
    workers = [auxi if i < splits - 1 else k - auxi * (splits - 1) for i in range(splits)]
    chunks, start = [], 0
    for i in range(splits):
        end = start + int(auxi / k * n)
        chunks.append(pairs[start:(n if i == splits - 1 else end)])
        start = end
    batches = []
    for chunk, kb in zip(chunks, workers, strict=True):
        size, smallest = len(chunk), -1
        while smallest < int(0.50 * size / kb):
            batch = [[] for _ in range(kb)]
            for c in np.unique(labels[pool]):
                idx = [i for i in chunk if labels[i] == c]
                p = rng.dirichlet(np.repeat(alpha, kb))
                p = np.array([pj * (len(bj) < size / kb) for pj, bj in zip(p, batch, strict=True)])
                p = p / p.sum()
                cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
                batch = [bj + part.tolist() for bj, part in
                         zip(batch, np.split(np.array(idx, dtype=np.int64), cuts), strict=True)]
            smallest = min(len(bj) for bj in batch)
        batches += batch
    flat = [i for b in batches for i in b]
    per, r = len(flat) // k, len(flat) % k
    parts, i = [], 0
    for j in range(k):
        step = per + 1 if j < r else per
        parts.append(np.sort(np.array(flat[i:i + step], dtype=np.int64)))
        i += step
    return batches, parts


@pytest.mark.parametrize("k, alpha, imbalance, seed", [(20, 0.5, 10.0, 0), (25, 1.0, 5.0, 3),
                                                       (7, 0.5, 2.0, 1)])
def test_longtail_is_creffs_block_draw(k, alpha, imbalance, seed):
    from privfedcal.data.partition import creff_block_clients

    labels = np.random.default_rng(7).integers(0, 10, size=3000)
    spec = PartitionSpec(scheme="longtail", num_clients=k, alpha=alpha, imbalance_factor=imbalance)
    ours = partition_indices(labels, spec, seed)
    pool = longtail_subset(labels, imbalance, seed)
    blocks, ref = reference_creff_blocks(labels, pool, k, alpha, np.random.default_rng([seed, 1]))
    assert all(np.array_equal(a, b) for a, b in zip(ours, ref, strict=True))
    ours_blocks = creff_block_clients(labels, pool, spec, np.random.default_rng([seed, 1]))
    assert [b.tolist() for b in ours_blocks] == blocks
    # by hand: K = 25 -> blocks of floor(10/25 N), floor(10/25 N) and the rest, 10/10/5 clients,
    # each block client with at least half its block's mean size
    n = len(pool)
    step = int(10 / k * n)
    bounds = [(i * step, n if i == -(-k // 10) - 1 else (i + 1) * step) for i in range(-(-k // 10))]
    for i, (lo, hi) in enumerate(bounds):
        kb = 10 if i < len(bounds) - 1 else k - 10 * (len(bounds) - 1)
        mine = ours_blocks[10 * i: 10 * i + kb]
        assert sum(map(len, mine)) == hi - lo
        assert min(map(len, mine)) >= int(0.5 * (hi - lo) / kb)
    sizes = [len(p) for p in ours]
    assert sizes == [n // k + (j < n % k) for j in range(k)]


def test_min_size_default_is_ten():
    from privfedcal.settings.run_config import RunConfig

    assert PartitionSpec().min_size == RunConfig().data.min_size == 10
