"""The harness's invariants, each checked on a ``ServerView`` (the server's folder alone):

* ``isolation`` (a): no group of fewer than m clients is determined by the released secure
  sums with every public constraint (each sum's contributors, the public class totals, an
  observer's own values, and for counts the clients' clear sizes with non-negative integer
  and subset-sum splits of small groups);
* ``charged`` (b): every release the server holds is charged: each client's epsilon
  recomputed from the releases and the public plan with opacus' RDP accountant is at most
  the reported one, which is at most the target;
* ``records`` (c): every file and field of ``server/`` is declared (``schema.py``), free text
  holds public numbers only, every missing upload of a secure sum is listed, a divergence
  under secure aggregation names no client, and no per-client file time.

Each returns a list of ``Violation``; none shares code with the package's planner or checker.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from .exact import combination, determined_groups, echelon, group_determined, subset_splits
from .view import Release, ServerView


@dataclass(frozen=True)
class Violation:
    invariant: str  # "isolation", "charged", "records", "timing"
    detail: str
    found: tuple = ()  # what the check derived (a split: (client, counts) pairs)

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def secure_rows(view: ServerView) -> list[tuple[Release, list[int]]]:
    """Every secure sum the server holds with its contributors' indicator row."""
    n = view.clients
    return [(r, [int(c in r.contributors) for c in range(n)]) for r in view.releases
            if r.view == "aggregate" and r.contributors]


def isolation(view: ServerView, observers: tuple[int, ...] = ()) -> list[Violation]:
    """Invariant (a) on the participation rows, then on the counts with clear sizes."""
    cfg = view.config
    if not (cfg.get("secagg") or cfg.get("secagg_updates")):
        return []
    m, n = int(cfg.get("secagg_min_clients") or 2), view.clients
    rows = [row for _, row in secure_rows(view)]
    if not rows:
        return []
    rows.append([1] * n)  # the public total (the training split's class histogram)
    out = []
    for known in [(), *((k,) for k in observers)]:
        for group in determined_groups(rows, n, m, known):
            who = "the server" if not known else f"an observer holding client {known[0]}"
            out.append(Violation("isolation", f"{who} determines a combination of clients "
                                 f"{list(group)} (fewer than {m})"))
    return out + count_splits(view)


def clear_sizes(view: ServerView) -> dict[int, int]:
    """Clients' sizes the server saw in the clear: FedAvg weights of plain model updates,
    when they are integers that differ between clients (equal weights are public
    constants, not sizes)."""
    seen: dict[int, float] = {}
    for r in view.releases:
        if r.view == "plain-upload" and r.label == "model-update" and r.weight is not None:
            seen[r.contributors[0]] = float(r.weight)
    if len(set(seen.values())) < 2 or any(w != int(w) for w in seen.values()):
        return {}
    return {c: int(w) for c, w in seen.items()}


def count_splits(view: ServerView, largest: int = 3) -> list[Violation]:
    """Groups of at most ``largest`` clients whose summed class counts follow from the
    count-carrying sums, split into single clients by their clear sizes: a unique subset-sum
    split (every class wholly to one member) gives each member's counts."""
    sizes = clear_sizes(view)
    counted = [(r, row) for r, row in secure_rows(view) if r.counts is not None]
    if not sizes or not counted or view.config.get("dp_eps"):
        return []  # no sizes, no counts, or noisy counts: nothing exact to split
    n = view.clients
    rows = [row for _, row in counted] + [[1] * n]
    sums = [r.counts for r, _ in counted]
    basis = echelon(rows[:-1])
    out = []
    for size in range(2, largest + 1):
        for group in combinations(range(n), size):
            indicator = [int(c in group) for c in range(n)]
            coef = combination(rows[:-1], indicator)
            if coef is None or any(group_determined(basis, g, n) for g in
                                   combinations(group, size - 1)):
                continue  # not determined, or not a minimal group
            totals = [round(float(sum(k * s[j] for k, s in zip(coef, sums, strict=True))))
                      for j in range(len(sums[0]))]
            if any(c not in sizes for c in group):
                continue
            splits = subset_splits(totals, [sizes[c] for c in group])
            if len(splits) == 1:
                found = tuple((c, tuple(t if owner == k else 0 for t, owner in
                                        zip(totals, splits[0], strict=True)))
                              for k, c in enumerate(group))
                out.append(Violation("isolation", f"group {list(group)}: its summed counts "
                                     f"{totals} split uniquely by the clear sizes "
                                     f"{[sizes[c] for c in group]} (subset-sum)", found))
    return out
