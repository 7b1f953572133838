"""``privfedcal compare``: one row per run folder, the accuracy curves overlaid, flags where
runs are not comparable (different datasets, privacy budgets or round counts), and every
setting that differs between the runs, named per run."""

from __future__ import annotations

import csv
import json
import math
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from privfedcal.report import html as H
from privfedcal.report.reading import load_run
from privfedcal.report.run_report import worst_class

COLUMNS = ("run", "method", "dataset", "partition", "rounds", "accuracy_before",
           "accuracy_after", "worst_class", "epsilon", "bytes", "wall_seconds", "flags",
           "differs")
HEADERS = ("run", "method", "dataset", "partition", "rounds", "acc. before calib.",
           "acc. after calib.", "worst class", "epsilon", "bytes uploaded", "wall time (s)",
           "flags", "settings that differ")
#: config keys that say where or how fast a run ran, not what it computed
RUNTIME_KEYS = frozenset({"out", "threads", "workers", "data_root", "flower_run_id"})


def _partition(cfg: dict[str, Any]) -> str:
    scheme = cfg.get("partition")
    if scheme is None:
        return "?"
    extra = {"dirichlet": f" a={cfg.get('alpha')}", "longtail": f" IF={cfg.get('imbalance_factor')}",
             "shards": f" s={cfg.get('shards_per_client')}"}.get(scheme, "")
    return f"{scheme}{extra} K={cfg.get('clients')}"


def budget(summary: dict[str, Any]) -> str:
    """The privacy budget a run was given ('none' without DP)."""
    p = summary.get("privacy") or {}
    if "epsilon_target" not in p:
        return "none"
    return f"eps={p['epsilon_target']:g}, delta={p.get('delta', 0):.2g}"


def run_row(run_dir: Path) -> dict[str, Any]:
    summary, cfg = load_run(run_dir)
    worst = worst_class(summary)
    privacy = summary.get("privacy") or {}
    method = str(summary.get("method", "?"))
    calibrated = summary.get("calibrator") not in (None, "none")
    if calibrated and summary["calibrator"] != method:
        method += f" + {summary['calibrator']}"
    return {
        "run": str(run_dir), "method": method, "dataset": summary.get("dataset", "?"),
        "partition": _partition(cfg), "rounds": summary.get("rounds"),
        # a run without a calibrator has no "after": its final accuracy is the "before"
        "accuracy_before": (summary.get("accuracy_before_calibration") if calibrated
                            else summary.get("accuracy")),
        "accuracy_after": summary.get("accuracy") if calibrated else None,
        "worst_class": worst[1] if worst else None,
        "epsilon": privacy.get("epsilon_spent"),
        "bytes": (summary.get("calibration_upload_bytes", summary.get("uploaded_bytes")) or 0)
        + (summary.get("model_update_bytes") or 0),
        "wall_seconds": summary.get("wall_seconds"),
        "budget": budget(summary), "flags": "", "differs": "",
        "_curve": _curve(run_dir), "_settings": settings_of(resolved(cfg)),
    }


def resolved(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config as what it runs: a method alias (``--method ccvr``) as its local method and
    calibrator (fedavg, calibrate ccvr), so that it does not differ from the same run spelt
    ``--method fedavg --calibrate ccvr``, nor show ``calibrate none``."""
    from privfedcal.settings.run_config import METHOD_ALIASES

    method = cfg.get("method")
    if method not in METHOD_ALIASES:
        return cfg
    local, calibrator = METHOD_ALIASES[method]
    return dict(cfg, method=local, calibrate=(calibrator if cfg.get("calibrate", "none") == "none"
                                              else cfg["calibrate"]))


def settings_of(cfg: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A run's config as flat ``key -> JSON text`` (nested tables such as method_params and
    versions as ``table.key``), without the runtime keys."""
    out: dict[str, str] = {}
    for key, value in cfg.items():
        if key in RUNTIME_KEYS:
            continue
        if isinstance(value, dict):
            out.update(settings_of(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True, default=str)
    return out


def differing_settings(rows: list[dict[str, Any]]) -> list[str]:
    """Every setting whose value is not the same in all runs (a setting a run lacks counts
    as a value): sets each row's ``differs`` to ``key=value`` for the settings where it
    departs from the majority value (every run's value when there is no majority) and
    returns one line naming each such setting with its values."""
    keys = sorted(set().union(*(r["_settings"] for r in rows))) if rows else []
    lines = []
    for key in keys:
        values = [r["_settings"].get(key, "(unset)") for r in rows]
        counts = Counter(values)
        if len(counts) <= 1:
            continue
        (common, n), = counts.most_common(1)
        majority = common if n > len(rows) / 2 else None
        lines.append(f"{key}: " + ", ".join(f"{v} ({k} run{'s' if k > 1 else ''})"
                                            for v, k in counts.items()))
        for r, v in zip(rows, values, strict=True):
            if v != majority:
                r["differs"] = ", ".join(x for x in (r["differs"], f"{key}={v}") if x)
    return lines


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    from privfedcal.report.run_plots import read_metrics

    return [(int(r["round"]), float(r["accuracy"])) for r in read_metrics(run_dir / "metrics.jsonl")]


def flag(rows: list[dict[str, Any]]) -> list[str]:
    """Mark runs whose dataset or budget differs from the others: from the majority value
    when there is one, else every run. Sets ``flags`` (long) and ``flag`` (short); returns
    one warning per differing field."""
    warnings = []
    for r in rows:
        r.setdefault("flag", "")
    for key, what in (("dataset", "dataset"), ("budget", "privacy budget"),
                      ("rounds", "rounds")):
        counts = Counter(r[key] for r in rows)
        if len(counts) <= 1:
            continue
        (common, n), = counts.most_common(1)
        majority = common if n > len(rows) / 2 else None
        warnings.append(f"runs differ in {what}: " + ", ".join(
            f"{v} ({k} run{'s' if k > 1 else ''})" for v, k in counts.items()))
        for r in rows:
            if r[key] != majority:
                r["flags"] = "; ".join(x for x in (r["flags"], f"{what} differs: {r[key]}") if x)
                r["flag"] = ",".join(x for x in (r["flag"], key.replace("budget", "eps")) if x)
    return warnings


def collect(run_dirs: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of the runs and the warnings of flagged (not comparable) fields; each row's
    ``differs`` names the settings where it departs from the others."""
    rows = [run_row(Path(d)) for d in run_dirs]
    differing_settings(rows)
    return rows, flag(rows)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("accuracy_before", "accuracy_after", "worst_class"):
        return f"{100 * value:.2f} %"
    if key == "epsilon":
        return f"{value:.3f}"
    if key == "bytes":
        return H.fmt_bytes(value)
    if key == "wall_seconds":
        return f"{value:.1f}"
    return str(value)


def display_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[_cell(k, r.get(k)) for k in COLUMNS] for r in rows]


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=(*COLUMNS, "budget"), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                        for k, v in r.items() if not k.startswith("_")})
    return path


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    """Short unique curve labels: the method, with the folder name when methods repeat."""
    names = Counter(r["method"] for r in rows)
    return [r["method"] if names[r["method"]] == 1 else f"{r['method']} ({Path(r['run']).name})"
            for r in rows]


def write_html(rows: list[dict[str, Any]], warnings: list[str], path: Path) -> Path:
    from privfedcal.report.run_plots import plot_curves

    body = [f'<div class="flag">{H.esc(w)}: flagged rows are not comparable with the rest.'
            "</div>" for w in warnings]
    lines = differing_settings([dict(r, differs="") for r in rows])
    if lines:
        body.append("<p>Settings that differ between the runs:</p><ul>"
                    + "".join(f"<li>{H.esc(x)}</li>" for x in lines) + "</ul>")
    with tempfile.TemporaryDirectory() as tmp:
        curves = dict(zip(_labels(rows), (r["_curve"] for r in rows), strict=True))
        png = plot_curves(curves, Path(tmp) / "curves.png")
        body.append(H.figure(png, "accuracy curves", "test accuracy per evaluated round of what each "
                             "run evaluates: the global model before post-hoc calibration, or "
                             "for a calibrator that re-trains the head every round (CReFF) "
                             "the model with that head"))
    cells = display_rows(rows)
    numeric = [k in ("rounds", "accuracy_before", "accuracy_after", "worst_class", "epsilon",
                     "bytes", "wall_seconds") for k in COLUMNS]
    body.append(H.table(HEADERS, cells, numeric=numeric, table_id="compare",
                        row_classes=["flagged" if r["flags"] else "" for r in rows]))
    body.append("<p>Accuracy after calibration: '-' for a run without a calibrator (its "
                "final accuracy is the one before), and before calibration '-' for a "
                "calibrator that re-trains the head every round (CReFF). "
                "Bytes: calibration uploads plus model updates sent by clients. Epsilon: "
                "spent by the end of the run ('-' without DP). Worst class: lowest per-class "
                "test accuracy of the final model.</p>")
    return H.write(path, H.page("privfedcal compare", f"{len(rows)} runs", "\n".join(body),
                                "privfedcal compare"))
