"""How ``attack disaggregate`` shows its records: a table per (label, key), a verdict line
per label, ``disaggregation.png`` (each label's participation matrix with what it
determines, and every scored client's error on a log scale), and its section of the run
report (``section``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from privfedcal.attacks.release_attacks import ReportTable
from privfedcal.report.style.plotstyle import colour, new_figure, save, styled

#: the ``target`` of the disaggregation's records (``disaggregate_attack.py``)
TARGET = "disaggregate"
COLUMNS = ("release", "key", "sums", "determined", "finest", "total", "exact", "mean err",
           "worst-off", "worst err", "fit resid")


def _num(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def rows(records: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per (label, key), in the order of ``COLUMNS``."""
    return [[r["label"], r["key"], str(r["releases"]),
             f"{r['determined']}/{r['clients']}", _num(r["finest_group"]),
             r["public_total"] or "none",
             "-" if r["exact"] is None else f"{r['exact']}/{r['clients']}",
             _num(r["mean_rel_error"]),
             "-" if r["worst_client"] is None else f"k{r['worst_client']}",
             _num(r["worst_rel_error"]), _num(r["fit_residual"])]
            for r in summarise(records)]


def summarise(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (label, key): how many clients are determined, the finest group, and
    the mean error with the worst-off (best-recovered) client beside it."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("target") == TARGET:
            rows.setdefault((r["label"], r["key"]), []).append(r)
    out = []
    for (label, key), rs in rows.items():
        scored = [r for r in rs if r["scored"]]
        worst = min(scored, key=lambda r: r["rel_error"]) if scored else None
        out.append({
            "label": label, "key": key, "kind": rs[0]["kind"], "releases": rs[0]["releases"],
            "clients": len(rs), "determined": sum(r["determined"] for r in rs),
            "finest_group": rs[0]["finest_group"], "public_total": rs[0]["public_total"],
            "fit_residual": rs[0]["fit_residual"],
            "exact": sum(bool(r["exact"]) for r in scored) if scored else None,
            "mean_rel_error": float(np.mean([r["rel_error"] for r in scored]))
            if scored else None,
            "worst_client": None if worst is None else worst["client"],
            "worst_rel_error": None if worst is None else worst["rel_error"],
            "worst_max_abs_error": None if worst is None else worst["max_abs_error"]})
    return out


def table(records: Sequence[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("release", "key", "total", "worst-off")
                     else "right")
    for row in rows(records):
        t.add_row(*row)
    return t


def verdicts(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per label: the finest group of clients the server resolves."""
    out = []
    for label in dict.fromkeys(r["label"] for r in summarise(records)):
        rs = [r for r in summarise(records) if r["label"] == label]
        sizes = [r["finest_group"] for r in rs if r["finest_group"] is not None]
        k = rs[0]["clients"]
        if not sizes:
            out.append(f"{label}: no group of clients smaller than the whole federation has a "
                       "determined sum")
        elif min(sizes) == 1:
            best = max(rs, key=lambda r: r["determined"])
            out.append(f"{label}: individual values are determined for {best['determined']} "
                       f"of {k} clients ({best['key']!r})")
        else:
            out.append(f"{label}: nothing finer than a group of {min(sizes)} clients is "
                       f"determined (of {k})")
    return out


def console(records: Sequence[dict[str, Any]], title: str) -> tuple[Table, list[str]]:
    """What ``attack disaggregate`` prints: its table and a verdict line per label."""
    return table(records, title), verdicts(records)


def section(records: Sequence[dict[str, Any]]) -> ReportTable:
    """The run report's section: a row per (release, payload key), a verdict per release
    (docs/privacy/attacks.md, "Disaggregation across rounds")."""
    return ReportTable(
        COLUMNS, rows(records),
        numeric=tuple(c not in ("release", "key", "total", "worst-off") for c in COLUMNS),
        notes=(*(f"{v}." for v in verdicts(records)),
               "Determined: the sums fix the client's own value (e_i in the row space of the "
               "participation matrix); finest: the smallest group of clients whose sum is "
               "determined; errors under one rule for every row (relative L2 error; "
               "worst-off: the best-recovered client)."),
        table_id="disaggregation")


def plot(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Left: each label's participation matrix (rows: releases, and the public total where
    one is used; columns: clients, a client whose own value is determined starred). Right: every scored client's relative
    error per key, log scale (filled: determined)."""
    labels = list(dict.fromkeys(r["label"] for r in records))
    scored = [r for r in records if r["scored"]]
    with styled():
        fig = new_figure(4 + 3.2 * len(labels) + (4 if scored else 0), 3.6)
        axes = fig.subplots(1, len(labels) + (1 if scored else 0), squeeze=False)[0]
        for ax, label in zip(axes, labels, strict=False):
            _matrix(ax, [r for r in records if r["label"] == label])
        if scored:
            _errors(axes[-1], scored)
        return save(fig, path, dpi=110)


def _matrix(ax, rs: list[dict[str, Any]]) -> None:
    import numpy as np

    first = rs[0]
    k = max(r["client"] for r in rs) + 1
    names = [f"r{r}" for r in first["rounds"]]
    mat = np.zeros((len(names), k))
    for i, members in enumerate(first["participants"]):
        mat[i, members] = 1
    totals = sorted({r["public_total"] for r in rs if r["public_total"]})
    if totals:  # the public all-clients total, for the keys that have one
        mat = np.vstack([mat, np.full(k, 0.6)])
        names.append("total")
    ax.imshow(mat, cmap="Greys", vmin=0, vmax=1.6, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(names)), names)
    det = {r["client"] for r in rs if r["determined"] and r["kind"] == "constant"} or {
        r["client"] for r in rs if r["determined"]}
    ax.set_xticks(range(k), [f"{c}*" if c in det else str(c) for c in range(k)])
    ax.set_xlabel("client (* determined)")
    ax.set_title(f"{first['label']}: who is in each sum"
                 + (f" (+ public total: {', '.join(totals)})" if totals else ""), fontsize=8)


def _errors(ax, scored: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys((r["label"], r["key"]) for r in scored))
    for i, (label, key) in enumerate(keys):
        rs = [r for r in scored if (r["label"], r["key"]) == (label, key)]
        for r in rs:
            err = max(r["rel_error"], 1e-9)
            ax.scatter(r["client"], err, color=colour(i), s=30,
                       facecolors=colour(i) if r["determined"] else "none",
                       label=f"{label} {key}" if r is rs[0] else None)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["client"] for r in scored}))
    ax.set_xlabel("client")
    ax.set_ylabel("relative error of the estimate")
    ax.legend(fontsize=6)
    ax.set_title("recovered vs true (filled: determined)", fontsize=8)
