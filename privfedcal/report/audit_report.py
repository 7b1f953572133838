"""``report.html`` of an audit folder (``audit.csv`` + ``runs/<setting>/``): the trade-off
plot (utility vs attack success, mean and worst case where the CSV has worst-case columns),
the table, and the most exposed targets of every setting.

The CSV is read as it is: columns the audit did not write are simply not shown, so the page
works for audits written before and after worst-case columns existed.
"""

from __future__ import annotations

import csv
import math
import tempfile
from pathlib import Path
from typing import Any, TypeGuard

from privfedcal.errors import UsageError
from privfedcal.report import html as H
from privfedcal.report.reading import load_json
from privfedcal.report.style.plotstyle import (
    MARKERS,
    colour,
    label_points,
    new_figure,
    save,
    styled,
)

#: attack metrics (higher = more leakage) and the names a worst-case column may carry
METRICS = (("psnr", "reconstruction PSNR (dB)"), ("ssim", "reconstruction SSIM"),
           ("class_inference_accuracy", "class-inference accuracy"))
WORST_SUFFIXES = ("{m}_max", "{m}_worst", "worst_{m}", "max_{m}")
TOP_TARGETS = 3
#: columns that name a setting, repeated at the left of each table on the page
SETTING_COLUMNS = ("method", "eps", "secagg")
#: the worst-case columns (the first table); every other column goes in the second
WORST_COLUMNS = ("accuracy", "epsilon_spent", "epsilon_from_transcript", "psnr_max",
                 "nearest_of_worst", "worst_client", "worst_class", "worst_target",
                 "prior_psnr_max")
#: what the attacks on a run as a whole find (disaggregation across rounds): a third table
WHOLE_RUN_COLUMNS = ("disaggregated", "finest_group")
#: the most columns one table of the page has (it fits the page without scrolling)
TABLE_COLUMNS = 12
#: readable table headers for the audit's CSV columns (others are shown as named)
HEADERS = {"eps": "ε target", "secagg": "secure agg.", "accuracy": "accuracy",
           "psnr": "PSNR", "ssim": "SSIM", "feature_cosine": "feat. cos",
           "class_inference_accuracy": "class inf.", "epsilon_spent": "ε spent",
           "epsilon_from_transcript": "ε held",
           "prior_psnr": "prior PSNR", "psnr_max": "PSNR worst", "nearest_is_true": "NN true",
           "nearest_chance": "NN chance", "targets": "targets", "prior_psnr_max": "prior worst",
           "nearest_of_worst": "NN of worst", "worst_client": "worst client",
           "worst_class": "worst class", "worst_target": "worst target",
           "disaggregated": "clients disaggregated", "finest_group": "finest group"}


def _value(text: str | None) -> Any:
    if text is None or text == "":
        return None
    low = text.strip().lower()
    if low in ("on", "off"):
        return low == "on"
    try:
        return float(text)
    except ValueError:
        return text


def read_audit(audit_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    path = Path(audit_dir) / "audit.csv"
    if not path.is_file():
        raise UsageError(f"{audit_dir} has no audit.csv")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = [{k: _value(v) for k, v in row.items()} for row in reader]
        return list(reader.fieldnames or []), rows


def worst_column(metric: str, columns: list[str]) -> str | None:
    for pattern in WORST_SUFFIXES:
        name = pattern.format(m=metric)
        if name in columns:
            return name
    return None


def setting_name(row: dict[str, Any]) -> str:
    eps = row.get("eps")
    eps_s = "inf" if eps is None or (isinstance(eps, float) and math.isinf(eps)) else f"{eps:g}"
    return f"{row.get('method')}-eps{eps_s}-secagg-{'on' if row.get('secagg') else 'off'}"


def _finite(v: Any) -> TypeGuard[float]:
    return isinstance(v, float) and math.isfinite(v)


def plot_tradeoff(rows: list[dict[str, Any]], columns: list[str], out: Path) -> Path | None:
    """One panel per attack metric in the CSV: test accuracy against attack success; filled
    marker = mean over targets, hollow marker joined to it = worst case (most exposed)."""
    panels = [(m, label) for m, label in METRICS if m in columns]
    done = [r for r in rows if _finite(r.get("accuracy"))]
    if not panels or not done:
        return None
    methods = list(dict.fromkeys(str(r.get("method")) for r in done))
    with styled():
        fig = new_figure(3.9 * len(panels), 3.8)
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        for ax, (metric, label) in zip(axes, panels, strict=True):
            worst = worst_column(metric, columns)
            labels: list[tuple[float, float, str]] = []
            for i, method in enumerate(methods):
                for r in (r for r in done if str(r.get("method")) == method):
                    x, y = r.get(metric), 100 * r["accuracy"]
                    if not _finite(x):
                        continue
                    marker = "s" if r.get("secagg") else MARKERS[0]
                    unprotected = (r.get("eps") is None or math.isinf(r["eps"])) and not r.get(
                        "secagg")
                    ax.scatter(x, y, marker="*" if unprotected else marker, color=colour(i),
                               s=170 if unprotected else 45, zorder=4,
                               edgecolors="black" if unprotected else "none")
                    if worst and _finite(r.get(worst)):
                        ax.plot([x, r[worst]], [y, y], color=colour(i), lw=0.8, alpha=0.7)
                        ax.scatter(r[worst], y, marker=marker, facecolors="white",
                                   edgecolors=colour(i), s=45, zorder=4)
                    eps = r.get("eps")
                    eps_s = "inf" if eps is None or math.isinf(eps) else f"{eps:g}"
                    labels.append((x, y, f"ε={eps_s}{' SA' if r.get('secagg') else ''}"))
            ax.margins(x=0.12, y=0.08)  # room for labels at the edges
            label_points(ax, labels, fontsize=8)
            ax.set_xlabel(label + (" - mean (filled), worst (hollow)" if worst else " - mean"))
            if metric == "psnr":
                prior = [v for v in (r.get("prior_psnr") for r in done) if _finite(v)]
                if prior:
                    p = sum(prior) / len(prior)
                    ax.axvline(p, ls="--", color="grey", lw=1)
                    ax.annotate("data-free prior", (p, 0.98), xycoords=("data", "axes fraction"),
                                fontsize=8, color="grey", rotation=90, ha="right", va="top")
        axes[0].set_ylabel("test accuracy (%)")
        handles = [axes[0].scatter([], [], color=colour(i), marker="o", label=m)
                   for i, m in enumerate(methods)]
        handles += [axes[0].scatter([], [], color="grey", marker="s", label="secure aggregation"),
                    axes[0].scatter([], [], color="grey", marker="*", s=120, edgecolors="black",
                                    label="unprotected")]
        fig.legend(handles=handles, loc="outside upper center", ncol=len(handles), frameon=False)
        return save(fig, out, dpi=100)


def _cell(column: str, value: Any) -> str:
    """Whole numbers as such (eps 2, targets 18); PSNR in dB with 2 decimals; other
    fractions with 3 (so epsilon spent 1.998 never shows as 2)."""
    if isinstance(value, float) and math.isfinite(value):
        if value.is_integer() and column in ("eps", "targets", "worst_client", "worst_class",
                                                       "finest_group"):
            return str(int(value))
        return H.fmt_fixed(value, 2 if "psnr" in column else 3)
    return H.fmt_num(value)


def _exposed(setting_dir: Path) -> list[dict[str, Any]]:
    records = load_json(setting_dir / "attack.json") or []
    if isinstance(records, dict):  # an interrupted attack: its finished targets
        records = records.get("records") or []
    def exposure(r: dict[str, Any]) -> float:  # best single image where records carry it
        v = r.get("psnr_best", r.get("psnr"))
        return float(v) if _finite(v) or isinstance(v, int) else -math.inf

    scored = [r for r in records if math.isfinite(exposure(r))]
    return sorted(scored, key=exposure, reverse=True)[:TOP_TARGETS]


def _audit_cards(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """The cards at the top: settings trained, the best accuracy, the highest PSNR."""
    attacked = [r for r in rows if _finite(r.get("accuracy"))]
    cards = [H.card("settings", str(len(rows)), f"{len(attacked)} trained")]
    if attacked:
        best = max(attacked, key=lambda r: r["accuracy"])
        cards.append(H.card("best accuracy", H.fmt_pct(best["accuracy"]), setting_name(best)))
    psnr_worst = worst_column("psnr", columns) or ("psnr" if "psnr" in columns else None)
    if psnr_worst:
        exposed = [r for r in rows if _finite(r.get(psnr_worst))]
        if exposed:
            top = max(exposed, key=lambda r: r[psnr_worst])
            cards.append(H.card("highest PSNR", f"{top[psnr_worst]:.2f} dB", setting_name(top)))
    return f'<div class="cards">{"".join(cards)}</div>'


def _tradeoff_section(audit_dir: Path, rows: list[dict[str, Any]], columns: list[str]
                      ) -> list[str]:
    """Accuracy against leakage, one point per setting (or the audit's own PNG)."""
    parts = ["<h2>Utility against leakage</h2>"]
    with tempfile.TemporaryDirectory() as tmp:
        png = plot_tradeoff(rows, columns, Path(tmp) / "tradeoff.png")
        if png:
            parts.append(H.figure(png, "audit trade-off",
                                  "each point is one protection setting; up is more accurate, "
                                  "right is more leakage. Star: no protection; square: secure "
                                  "aggregation; grey dashed: PSNR of a data-free guess"))
        elif (audit_dir / "audit.png").is_file():
            parts.append(H.figure(audit_dir / "audit.png", "audit plot"))
        else:
            parts.append("<p>No setting was trained and attacked: nothing to plot.</p>")
    return parts


def _settings_tables(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """Every column of ``audit.csv`` in tables of at most TABLE_COLUMNS columns each (one wide
    table scrolled sideways reads badly): the setting and its worst-case individual first,
    then the means over its targets, then what the run's secure sums determine."""
    parts = ["<h2>Settings</h2>"]
    shown = [c for c in columns if c != "note"]  # notes have their own section below
    key = [c for c in SETTING_COLUMNS if c in shown]
    worst = [c for c in shown if c not in key and c in WORST_COLUMNS]
    whole = [c for c in shown if c in WHOLE_RUN_COLUMNS]
    rest = [c for c in shown if c not in key and c not in worst and c not in whole]
    for title, part, tid in (("Worst case over individuals", worst, "audit"),
                             ("Means over the attacked targets", rest, "audit-means"),
                             ("What the secure sums of the run determine", whole,
                              "audit-whole-run")):
        if not part:
            continue
        cols = key + part
        parts.append(f"<h3>{title}</h3>")
        parts.append(H.table([HEADERS.get(c, c.replace("_", " ")) for c in cols],
                             [[_cell(c, r.get(c)) for c in cols] for r in rows],
                             numeric=[c not in ("method", "secagg", "worst_target",
                                                "nearest_of_worst") for c in cols],
                             table_id=tid))
    parts.append("<p>PSNR, SSIM, feature cosine: mean over the attacked targets (higher = more "
                 "leakage); prior PSNR: a guess that uses no client data; NN true: share of "
                 "reconstructions whose nearest training image is the true one; clients "
                 "disaggregated: the most clients whose own value the run's secure sums "
                 "determine, finest group: the smallest group of clients whose sum they "
                 "determine (docs/privacy.md). Every column of <code>audit.csv</code> "
                 "is shown in one of the tables.</p>")
    return parts


def _exposed_section(audit_dir: Path, rows: list[dict[str, Any]]) -> list[str]:
    """Per setting: its most exposed targets and the PNGs of its attack folder."""
    parts = ["<h2>Most exposed targets per setting</h2>"]
    for r in rows:
        name = setting_name(r)
        setting_dir = audit_dir / "runs" / name
        top = _exposed(setting_dir) if setting_dir.is_dir() else []
        pngs = sorted(setting_dir.glob("*.png")) if setting_dir.is_dir() else []
        if not top and not pngs:
            continue
        parts.append(f"<h3>{H.esc(name)}</h3>")
        if top:
            parts.append(H.table(
                ["target", "client", "class", "n", "best PSNR (dB)", "mean PSNR", "prior PSNR",
                 "SSIM", "feature cos"],
                [[t.get("target"), "all" if t.get("client") is None else t.get("client"),
                  H.fmt_num(t.get("class")), t.get("n"),
                  H.fmt_fixed(t.get("psnr_best", t.get("psnr")), 3),
                  *(H.fmt_fixed(t.get(k), 3) for k in ("psnr", "prior_psnr", "ssim",
                                                    "feature_cosine"))] for t in top],
                numeric=[False, True, True, True, True, True, True, True, True]))
        for p in pngs:
            parts.append(H.figure(p, f"{name}: {p.stem}", p.stem.replace("_", " ")))
    return parts


def build_audit_report(audit_dir: Path, out: Path | None = None) -> Path:
    """Write ``audit_dir/report.html`` (or ``out``) and return its path."""
    audit_dir = Path(audit_dir)
    columns, rows = read_audit(audit_dir)
    out = Path(out) if out else audit_dir / "report.html"
    body = [_audit_cards(rows, columns)]
    body += _tradeoff_section(audit_dir, rows, columns)
    body += _settings_tables(rows, columns)
    body += _exposed_section(audit_dir, rows)
    notes = [(setting_name(r), r["note"]) for r in rows if r.get("note")]
    if notes:
        body.append("<h2>Notes</h2>" + "".join(
            f'<div class="note"><b>{H.esc(n)}</b>: {H.esc(t)}</div>' for n, t in notes))
    return H.write(out, H.page("privacy audit", str(audit_dir), "\n".join(body),
                               f"privfedcal audit report of {audit_dir.resolve()}"))
