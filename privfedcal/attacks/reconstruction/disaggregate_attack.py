"""``attack disaggregate``: every secure sum of a run, differenced into per-client values.

For every label the server received as secure aggregates (``view == "aggregate"`` in the
transcript; the summed clients are that release's ``ciphertext`` entries) and every key of
the payload, the releases of the whole run become one system ``A X = Y``
(``disaggregate.py``): ``A`` the participation matrix, ``Y`` the released sums. A public
total joins as a row of ones where the server knows one: the federation's size N
(``federation/setup.py`` ``held_examples``) for the update weights ``__weight``, the class
histogram of the public training split for hidden ``count`` (every scheme but long-tail
deals every example out, and long-tail keeps a public number per class; not with a
per-class cap). Values that do not change between rounds (the update weights ``__weight``,
and every payload key its release declares as counts or 0/1 indicators:
``class_inference.key_tests``, as CCVR's and CReFF's ``count`` and ``holders``) are solved
exactly; the others (class gradients, model updates) with Lam et
al.'s window assumption, the model updates first turned into weighted updates by taking
``w * sent state`` off each sum (the sent state and the weight sum are public).

One record per (label, key, client): the estimate, whether it is determined, the smallest
determined group holding the client, and, when the experimenter's side is at hand
(``RUN/private/partition.json``: ``counts`` (K, C), ``sizes`` (K,)), its error under one
rule for every row. A copy of ``server/`` alone is attacked unscored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.reconstruction import disaggregate as D
from privfedcal.attacks.reconstruction.class_inference import COUNT, INDICATOR, key_tests
from privfedcal.attacks.reconstruction.count_splits import split_cohort
from privfedcal.attacks.reconstruction.disaggregate_report import (
    TARGET,
    console,
    plot,
    section,
    summarise,
)
from privfedcal.attacks.release_attacks import ReleaseAttack
from privfedcal.attacks.view import RunView, release_spec
from privfedcal.errors import UsageError
from privfedcal.privacy.releases import ROUND_RECORD, UPDATE_RELEASE
from privfedcal.privacy.secagg_updates import UPDATE_WEIGHT
from privfedcal.settings.messages import SettingError

NAME = TARGET  # the attack, and the target of its records
#: estimates stored in a record when a value has at most this many entries
MAX_STORED = 256
#: where each public total comes from, by its first letter
TOTALS = {"N": "the federation's training examples: public dataset and partition scheme",
          "K": "the number of clients: uniform update weights under --dp-train",
          "c": "the class histogram of the public training split, which the clients hold "
               "together"}
#: an estimate within this of the truth, in every entry, rounds to it (counts, sizes)
EXACT = 0.5
#: the note of a run whose transcript shows no client size (uniform or no weights)
NO_SIZES = ("no client size in the server's view (update weights uniform, or only summed "
            "whole cohorts): no cohort's counts split by sizes")
#: cohorts of at most this many members are split with their sizes (count_splits.py)
MAX_SPLIT_MEMBERS = 6


@dataclass(frozen=True)
class DisaggregateOptions:
    """``attack disaggregate``: the window of releases and whether public totals join."""

    window: int = attack_option(0, "Releases over which a changing value (update, class "
                                "gradient) is taken as constant (0: the whole run).")
    public_totals: bool = attack_option(True, "Add the public all-clients totals (N for "
                                        "update weights, the public class totals for "
                                        "counts).", flag="--totals/--no-totals")
    sizes: bool = attack_option(True, "Split each cohort's determined class counts between "
                                "its members with their sizes where the transcript shows "
                                "them (clear update weights): integer bounds and the "
                                "whole-class subset-sum search.", flag="--sizes/--no-sizes")

    def __post_init__(self) -> None:
        if self.window < 0:
            raise SettingError(f"{{window}} must be >= 0 (0: the whole run), got {self.window}")


@dataclass
class Series:
    """One label's secure releases over the run: participation rows and summed payloads."""

    label: str
    rounds: list[int] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    sums: dict[str, list[np.ndarray]] = field(default_factory=dict)

    @property
    def matrix(self) -> np.ndarray:
        return np.stack(self.rows)


def secure_series(view: RunView) -> tuple[list[Series], list[str]]:
    """Every securely aggregated label of the run, its releases in round order."""
    k, notes = int(view.cfg.data.clients), []
    summed: dict[tuple[int, str], list[int]] = {}
    sent: dict[int, dict] = {}
    for e in view.entries:
        if e["view"] == "ciphertext":
            summed.setdefault((e["round"], e["label"]), []).append(int(e["client"]))
        elif e["label"] == ROUND_RECORD and e["view"] == "model-state":
            sent[e["round"]] = e.get("tensors") or {}
    out: dict[str, Series] = {}
    for e in view.entries:
        if e["view"] != "aggregate" or not e.get("tensors"):
            continue
        who = sorted(set(summed.get((e["round"], e["label"]), [])))
        if e.get("clients") is not None and len(who) != int(e["clients"]):
            notes.append(f"round {e['round']} {e['label']}: {e['clients']} uploads summed but "
                         f"{len(who)} ciphertexts recorded; release left out")
            continue
        row = np.zeros(k)
        row[who] = 1.0
        s = out.setdefault(e["label"], Series(e["label"]))
        s.rounds.append(int(e["round"]))
        s.rows.append(row)
        tensors = {key: v.double().cpu().numpy().ravel() for key, v in e["tensors"].items()}
        if e["label"] == UPDATE_RELEASE and UPDATE_WEIGHT in tensors:
            # sum_k w_k state_k - (sum_k w_k) sent = sum_k w_k update_k: updates change less
            # between rounds than states do
            w, state = float(tensors[UPDATE_WEIGHT][0]), sent.get(e["round"], {})
            tensors = {key: (v - w * state[key].double().cpu().numpy().ravel()
                             if key in state and key != UPDATE_WEIGHT else v)
                       for key, v in tensors.items()}
        for key, v in tensors.items():
            s.sums.setdefault(key, []).append(v)
    return list(out.values()), notes


def public_class_totals(cfg: Any) -> np.ndarray | None:
    """Per-class training examples the clients hold together, from the public dataset and
    partition scheme (as ``held_examples`` gives their number); None if unreadable."""
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition import longtail_counts

    try:
        data = load_dataset(cfg.data.dataset, cfg.data.data_root, download=False)
    except Exception:  # noqa: BLE001 - a dataset not at hand: no public total
        return None
    sizes = np.bincount(data.y_train.cpu().numpy(), minlength=data.num_classes)
    if cfg.data.partition in ("longtail", "longtail-dirichlet"):
        return longtail_counts(sizes, cfg.data.imbalance_factor).astype(np.float64)
    return sizes.astype(np.float64)


def key_test(label: str, key: str) -> str | None:
    """What payload ``key`` of release ``label`` holds (``class_inference.key_tests`` of
    the release's declaration); None for a key no calibrator declares (model updates)."""
    try:
        spec = release_spec(label)
    except UsageError:  # the uplink's own release (model updates): no declaration
        return None
    return key_tests(spec).get(key)


def is_constant(label: str, key: str) -> bool:
    """Whether the value of ``key`` is the same in every release of a run (one exact
    system): the update weights, and declared counts and indicators."""
    return key == UPDATE_WEIGHT or key_test(label, key) in (COUNT, INDICATOR)


def public_total(view: RunView, label: str, key: str, width: int, opts: DisaggregateOptions
                 ) -> tuple[np.ndarray | None, str | None]:
    """The public all-clients total of ``key`` (and how it is known), or (None, None)."""
    if not opts.public_totals:
        return None, None
    cap = view.cfg.calibration_params.get("per_class_cap")
    if key == UPDATE_WEIGHT and width == 1:
        if view.cfg.privacy.dp_train:
            return np.array([float(view.cfg.data.clients)]), f"K={view.cfg.data.clients}"
        return np.array([float(view.exp.num_examples)]), f"N={view.exp.num_examples}"
    if key_test(label, key) == COUNT and cap is None:
        totals = public_class_totals(view.cfg)
        if totals is not None and totals.shape == (width,):
            return totals, "class totals"
    return None, None


def clear_sizes(view: RunView) -> dict[int, float]:
    """Each client's FedAvg weight as the transcript shows it in the clear (an update sent
    in the clear is recorded with the weight the server used), where it is the same in every
    round. One weight for every client is nominal (uniform weights): none. Whether a weight
    is the client's size is also for the split to check: sizes add up to the cohort's count
    total."""
    seen: dict[int, set[float]] = {}
    for e in view.entries:
        if (e["label"] == UPDATE_RELEASE and e["view"] == "plain-upload"
                and e.get("weight") is not None):
            seen.setdefault(int(e["client"]), set()).add(float(e["weight"]))
    if len(set().union(*seen.values())) <= 1:  # one weight for all: nominal, no size
        return {}
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}


def cohort_splits(groups: Sequence[tuple[int, ...]], values: np.ndarray,
                  sizes: dict[int, float]) -> dict[int, dict[str, Any]]:
    """Per client of a determined group of 2..MAX_SPLIT_MEMBERS clients whose sizes are
    known (all, or all but one: the group's count total minus the others'): how the sizes
    split the group's summed counts (``count_splits.py``): ``"integer"`` (every integer
    split agrees), ``"whole-class"`` (one subset-sum assignment of whole classes fits) or
    None, with the split's counts."""
    out: dict[int, dict[str, Any]] = {}
    for g in groups:  # smallest first: a client keeps the split of its smallest group
        missing = [k for k in g if k not in sizes]
        if not 2 <= len(g) <= MAX_SPLIT_MEMBERS or len(missing) > 1 or any(k in out for k in g):
            continue
        sums = np.rint(values[list(g)].sum(axis=0))
        known = {k: sizes[k] for k in g if k in sizes}
        known.update({k: float(sums.sum()) - sum(known.values()) for k in missing})
        cut = split_cohort(g, sums, [known[k] for k in g])
        for i, k in enumerate(g):
            how, est = None, None
            if cut.determined[i]:
                how, est = "integer", cut.low[i]
            elif cut.whole_class is not None:
                how, est = "whole-class", cut.whole_class[i]
            out[k] = {"size": known[k], "cohort": list(g), "cohort_feasible": cut.feasible,
                      "whole_class_fits": cut.whole_class_fits, "split": how,
                      "split_value": None if est is None else [int(v) for v in est]}
    return out


def secure_sizes(view: RunView, series: Sequence[Series], opts: DisaggregateOptions
                 ) -> dict[int, float]:
    """Each client's size where the secure sums of the update weights (``__weight`` under
    --secagg-updates) determine it alone, with the public total N; none under --dp-train,
    whose weights are all 1."""
    s = next((x for x in series if x.label == UPDATE_RELEASE and UPDATE_WEIGHT in x.sums), None)
    if s is None or view.cfg.privacy.dp_train:
        return {}
    a, y = s.matrix, np.stack(s.sums[UPDATE_WEIGHT])
    total, _ = public_total(view, s.label, UPDATE_WEIGHT, 1, opts)
    if total is not None:
        a, y = np.vstack([a, np.ones(a.shape[1])]), np.vstack([y, total])
    sol = D.solve(a, y)
    return {c: float(np.rint(sol.values[c, 0])) for c in range(a.shape[1])
            if sol.determined[c]}


def _split_fields(c: int, splits: dict[int, dict[str, Any]], truth: np.ndarray | None
                  ) -> dict[str, Any]:
    got = splits.get(c)
    if got is None:
        return {"size": None, "split": None, "split_value": None, "split_exact": None}
    exact = None
    if got["split_value"] is not None and truth is not None:
        exact = bool(np.abs(np.asarray(got["split_value"]) - truth[c]).max() < EXACT)
    return {**got, "split_exact": exact}


def split_summary(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Cohorts the sizes were tried on, how many they split (any member), by which rule,
    and how many splits were exact (scored runs only)."""
    cohorts: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("cohort") is not None:
            cohorts.setdefault((r["label"], r["key"], tuple(r["cohort"])), []).append(r)
    split = [rs for rs in cohorts.values() if any(r["split"] for r in rs)]
    return {"cohorts": len(cohorts), "split": len(split),
            "integer": sum(any(r["split"] == "integer" for r in rs) for rs in split),
            "whole_class": sum(all(r["split"] != "integer" for r in rs) for rs in split),
            "exact": sum(all(r["split_exact"] for r in rs if r["split"]) for rs in split
                         if all(r["split_exact"] is not None for r in rs if r["split"]))}


def private_truth(view: RunView) -> dict[str, Any] | None:
    """The experimenter's ``private/partition.json`` (None on a server view alone)."""
    path = view.run_dir / "private" / "partition.json"
    return json.loads(path.read_text()) if path.is_file() else None


def truth_of(view: RunView, part: dict[str, Any] | None, label: str, key: str
             ) -> np.ndarray | None:
    """(K, D) true per-client values of a constant key, or None."""
    if part is None:
        return None
    counts = np.asarray(part["counts"], dtype=np.float64)
    cap = view.cfg.calibration_params.get("per_class_cap")
    test = key_test(label, key)
    if test == COUNT:
        return counts if cap is None else np.minimum(counts, float(cap))
    if test == INDICATOR:
        return (counts > 0).astype(np.float64)
    if key == UPDATE_WEIGHT:
        sizes = np.asarray(part["sizes"], dtype=np.float64)[:, None]
        return np.ones_like(sizes) if view.cfg.privacy.dp_train else sizes
    return None


def score(estimate: np.ndarray, truth: np.ndarray | None) -> dict[str, Any]:
    """One rule for every row: the largest absolute error, the relative L2 error and
    whether every entry rounds to the truth."""
    if truth is None:
        return {"scored": False, "max_abs_error": None, "rel_error": None, "exact": None}
    err = estimate - truth
    return {"scored": True, "max_abs_error": float(np.abs(err).max()),
            "rel_error": float(np.linalg.norm(err) / max(float(np.linalg.norm(truth)), 1.0)),
            "exact": bool(np.abs(err).max() < EXACT)}


def _records_of(view: RunView, s: Series, key: str, opts: DisaggregateOptions,
                part: dict[str, Any] | None, sizes: dict[int, float]
                ) -> list[dict[str, Any]]:
    a, y = s.matrix, np.stack(s.sums[key])
    constant = is_constant(s.label, key)
    total, how = public_total(view, s.label, key, y.shape[1], opts)
    if total is not None:
        a, y = np.vstack([a, np.ones(a.shape[1])]), np.vstack([y, total])
    groups, complete = D.finest_groups(a)
    if constant:
        sols = [D.solve(a, y)]
    else:  # Lam et al.: constant within each window of releases
        sols = D.solve_windows(a, y, opts.window)
    truth = truth_of(view, part, s.label, key) if constant else None
    splits = {}
    if opts.sizes and key_test(s.label, key) == COUNT and not base_dp(view, s, key):
        splits = cohort_splits(groups, sols[-1].values, sizes)
    base = {"target": TARGET, "label": s.label, "key": key, "view": "aggregate",
            "kind": "constant" if constant else "time-varying", "releases": len(s.rounds),
            "rounds": list(s.rounds),
            "participants": [[int(c) for c in np.flatnonzero(row)] for row in s.rows],
            "public_total": how, "rank": sols[-1].rank,
            "groups": [list(g) for g in groups], "groups_complete": complete,
            "finest_group": min((len(g) for g in groups), default=None),
            "windows": len(sols), "fit_residual": max(x.residual for x in sols),
            "dp": base_dp(view, s, key)}
    out = []
    for c in range(a.shape[1]):
        est = sols[-1].values[c]
        g = D.group_of(groups, c)
        out.append({**base, "client": c, "class": None,
                    "determined": bool(sols[-1].determined[c]),
                    "windows_determined": int(sum(bool(x.determined[c]) for x in sols)),
                    "group": None if g is None else list(g),
                    "value": [round(float(v), 4) for v in est] if est.size <= MAX_STORED
                    else None,
                    "norm": float(np.linalg.norm(est)),
                    "truth": None if truth is None or truth[c].size > MAX_STORED
                    else [float(v) for v in truth[c]],
                    **score(est, None if truth is None else truth[c]),
                    **(_split_fields(c, splits, truth) if splits else {})})
    return out


def base_dp(view: RunView, s: Series, key: str) -> bool:
    """Whether the releases of ``key`` were noised (then no sum is an integer count)."""
    return any(v > 0 for v in view.noise_stds(s.label, [key]).values())


def disaggregate_run(view: RunView, opts: DisaggregateOptions | None = None
                     ) -> tuple[list[dict[str, Any]], list[str]]:
    """Records (one per label, key and client) and notes for every secure release."""
    opts = opts or DisaggregateOptions()
    series, notes = secure_series(view)
    if not series:
        return [], ["no secure aggregate in the transcript: every upload reached the server "
                    "in the clear, so there is nothing to disaggregate"]
    part = private_truth(view)
    if part is None:
        notes.append("unscored: the clients' counts and sizes are on the experimenter's side "
                     "of the run folder (private/partition.json), not in the server's view")
    sizes = {**secure_sizes(view, series, opts), **clear_sizes(view)} if opts.sizes else {}
    records = [r for s in series for key in s.sums
               for r in _records_of(view, s, key, opts, part, sizes)]
    if not opts.public_totals:
        notes.append("no public totals used (--no-totals): the never-selected clients and "
                     "the last of each group stay undetermined")
    cut = split_summary(records)
    if opts.sizes and not sizes and any(key_test(r["label"], r["key"]) == COUNT
                                        for r in records):
        notes.append(NO_SIZES)
    if cut["cohorts"]:
        notes.append(f"client sizes (clear update weights, or the weights' secure sums) "
                     f"split {cut['split']} of "
                     f"{cut['cohorts']} cohorts' counts ({cut['integer']} by integer bounds, "
                     f"{cut['whole_class']} by one whole-class subset-sum fit; "
                     f"{cut['exact']} exact where scored)")
    for key, how in dict.fromkeys((r["key"], r["public_total"]) for r in records):
        if how:
            notes.append(f"public total of {key!r}: {how} ({TOTALS[how[0]]})")
    if any(r["kind"] == "time-varying" for r in records):
        notes.append("time-varying values (class gradients, model updates) are recovered "
                     "as each client's average over a window of releases (Lam et al.); no "
                     "per-client truth is in the run folder, so they are reported unscored "
                     "with the fit residual")
    return records, notes


def audit_columns(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The audit row's view of it: most clients determined in any (label, key), and the
    finest determined group (None: no secure release, nothing to disaggregate)."""
    rows = summarise(records)
    if not rows:
        return {"disaggregated": None, "finest_group": None}
    top = max(rows, key=lambda r: r["determined"])
    sizes = [r["finest_group"] for r in rows if r["finest_group"] is not None]
    return {"disaggregated": f"{top['determined']}/{top['clients']}",
            "finest_group": min(sizes) if sizes else None}


class DisaggregateAttack(ReleaseAttack):
    """Disaggregation of the run's secure sums, on the run as a whole (no one label)."""

    name = NAME
    targets = (TARGET,)
    options = DisaggregateOptions
    summary = ("Difference the run's secure sums over changing participant sets into "
               "per-client values (Lam et al., ICML 2021); say which clients and groups they "
               "determine.")
    figure = ("disaggregation.png", plot)
    run = staticmethod(disaggregate_run)
    audit_columns = staticmethod(audit_columns)
    console = staticmethod(console)
    report = staticmethod(section)


#: the attack, as the registry finds it (``release_attacks.RELEASE_ATTACKS``)
ATTACK = DisaggregateAttack()
