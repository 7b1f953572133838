"""``report.html`` of one run folder: whatever the folder holds is shown, nothing is required
but ``summary.json`` (a run that has not finished has no report). The attack and audit
sections are in ``attack_sections.py``; reading the folder's JSON in ``reading.py``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from privfedcal.report import html as H
from privfedcal.report.attack_sections import attack_sections, dp_audit_section
from privfedcal.report.reading import load_json, load_run

ANALYSIS_CAPTIONS = {
    "classifier_norms.png": "L2 norm of each class's classifier row, global model and after "
                            "calibration (CCVR fig. 3): uneven norms mean a biased classifier",
    "cka.png": "mean pairwise CKA between client models per layer (CCVR figs. 1-2): lower = "
               "clients disagree more; the scale starts near the smallest value",
    "singular_values.png": "singular values of the classifier weights (FedUV fig. 1): a fast "
                           "decay means a collapsed classifier",
}


def worst_class(summary: dict[str, Any], key: str = "per_class_accuracy"
                ) -> tuple[int, float] | None:
    values = summary.get(key) or []
    present = [(i, v) for i, v in enumerate(values) if v is not None]
    return min(present, key=lambda iv: iv[1]) if present else None


def ledger(privacy: dict[str, Any]) -> list[dict[str, Any]]:
    """The release ledger with the epsilon spent after each release group, recomputed with
    the run's accountant and delta over the releases up to it (a group = consecutive equal
    releases, as the accountant records them). A value already in the record wins."""
    rows = [dict(r) for r in privacy.get("releases") or []]
    kind, delta = privacy.get("accountant"), privacy.get("delta")
    entries: list[tuple[float, float, int]] = []
    for r in rows:
        entries.append((float(r["noise_multiplier"]), float(r.get("sample_rate", 1.0)),
                        int(r.get("steps", 1))))
        if "epsilon_spent" in r or kind is None or delta is None:
            continue
        try:
            from privfedcal.privacy.accounting import compute_epsilon

            r["epsilon_spent"] = compute_epsilon(list(entries), kind, float(delta))
        except Exception:  # an unknown accountant in an old folder: leave the cell empty
            r["epsilon_spent"] = None
    return rows


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def shown_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` as the Configuration table shows it: under a method alias (``--method
    ccvr`` is fedavg + ccvr) ``calibrate`` is the calibrator that ran, not the ``none`` the
    file keeps (``config.py`` ``RunConfig.calibrator``)."""
    from privfedcal.settings.run_config import METHOD_ALIASES

    method = config.get("method")
    if method in METHOD_ALIASES and config.get("calibrate", "none") == "none":
        local, calibrator = METHOD_ALIASES[method]
        return dict(config, calibrate=f"{calibrator} (--method {method} = {local} + {calibrator})")
    return config


def _partition_counts(run_dir: Path, config: dict[str, Any]) -> tuple[Any, list[str]] | None:
    """Client x class counts: ``private/partition.json`` when the run wrote one, else
    recomputed from the experimenter's config (same loader and data seed as the run); None
    when neither works (a server view, or a Flower server's folder, holds no data seed)."""
    from privfedcal.federation.runfolder import partition_file

    found = partition_file(run_dir)
    rec = load_json(found) if found else None
    if rec and "counts" in rec:
        return rec["counts"], rec.get("classes") or []
    data_seed = config.get("data_seed", config.get("seed")) if config else None
    if data_seed is None:
        return None
    try:
        from privfedcal.data.datasets import load_dataset
        from privfedcal.data.partition import PartitionSpec, class_counts, partition_dataset
        from privfedcal.settings.run_config import RunConfig

        cfg = RunConfig.from_dict({k: v for k, v in config.items() if k != "versions"})
        data = load_dataset(cfg.data.dataset, cfg.data.data_root, download=False)
        d = cfg.data
        spec = PartitionSpec(scheme=d.partition, num_clients=d.clients, alpha=d.alpha,
                             imbalance_factor=d.imbalance_factor,
                             shards_per_client=d.shards_per_client, min_size=d.min_size)
        parts = partition_dataset(data, spec, int(data_seed))
        return (class_counts(data.y_train.cpu().numpy(), parts, data.num_classes).tolist(),
                list(data.classes))
    except Exception:  # data moved or not readable: the report says so instead of failing
        return None





def _headline_cards(summary: dict[str, Any], classes: list[str]) -> str:
    """The cards at the top: accuracy (before and after calibration, worst class), epsilon,
    upload bytes and wall time, each checked against the summary key it shows."""
    cards = [H.card("test accuracy", H.checked(H.fmt_pct(summary.get("accuracy")), "accuracy",
                                               summary.get("accuracy"), 100),
                    f"after {summary.get('calibrator')}" if summary.get("calibrator") not in (
                        None, "none") else "final global model")]
    if "accuracy_before_calibration" in summary:
        cards.append(H.card("before calibration", H.checked(
            H.fmt_pct(summary["accuracy_before_calibration"]), "accuracy_before_calibration",
            summary["accuracy_before_calibration"], 100)))
    worst = worst_class(summary)
    if worst:
        name = classes[worst[0]] if worst[0] < len(classes) else str(worst[0])
        cards.append(H.card("worst class", H.checked(H.fmt_pct(worst[1]), "min:per_class_accuracy",
                                                     worst[1], 100), f"class {name}"))
    privacy = summary.get("privacy") or {}
    if "epsilon_spent" in privacy:
        cards.append(H.card("epsilon spent", H.checked(
            f"{privacy['epsilon_spent']:.3f}", "privacy.epsilon_spent", privacy["epsilon_spent"]),
            f"of {H.fmt_num(privacy.get('epsilon_target'))}, delta {privacy.get('delta', 0):.2g}"))
    else:
        cards.append(H.card("differential privacy", "none",
                            "secure aggregation only" if privacy.get("secagg") else
                            "uploads in the clear" if summary.get("calibrator") not in (
                                None, "none") else "no calibration upload"))
    up_key = next((k for k in ("calibration_upload_bytes", "uploaded_bytes") if k in summary),
                  None)  # older run folders have only uploaded_bytes
    if up_key:
        cards.append(H.card("calibration uploads", H.checked(
            H.fmt_bytes(summary[up_key]), up_key, summary[up_key]), f"{summary[up_key]:,} bytes"))
    if "model_update_bytes" in summary:
        cards.append(H.card("model updates", H.checked(
            H.fmt_bytes(summary["model_update_bytes"]), "model_update_bytes",
            summary["model_update_bytes"]), f"{summary['model_update_bytes']:,} bytes"))
    if "wall_seconds" in summary:
        cards.append(H.card("wall time", H.checked(f"{summary['wall_seconds']:.1f} s",
                                                   "wall_seconds", summary["wall_seconds"])))
    return f'<div class="cards">{"".join(cards)}</div>'


def _accuracy_section(run_dir: Path, summary: dict[str, Any], classes: list[str],
                      tmp: Path) -> list[str]:
    """Accuracy and training loss per round, and per-class accuracy (PNGs drawn in ``tmp``)."""
    from privfedcal.report.run_plots import plot_accuracy, plot_per_class, plot_train_loss

    parts = ["<h2>Accuracy</h2><div class=\"grid2\">",
             H.figure(plot_accuracy(run_dir / "metrics.jsonl", tmp / "acc.png", summary),
                      "accuracy per round", "test accuracy at each evaluated round (the "
                      "global model, or with the head a per-round calibrator re-trained "
                      "that round); the star is the accuracy after post-hoc "
                      "calibration")]
    loss_png = plot_train_loss(run_dir, tmp / "loss.png")
    if loss_png:
        parts.append(H.figure(loss_png, "training loss per round",
                              "mean local training loss of the sampled clients, every round"))
    parts.append("</div>")
    pca = summary.get("per_class_accuracy")
    if pca:
        before = summary.get("per_class_accuracy_before_calibration")
        parts.append("<h3>Per-class accuracy</h3>")
        parts.append(H.figure(plot_per_class(pca, tmp / "pc.png", before=before,
                                             class_names=classes or None),
                              "per-class accuracy",
                              "test accuracy of each class" + (
                                  " before (hatched) and after calibration" if before else "")))
    return parts


def _partition_section(summary: dict[str, Any], config: dict[str, Any],
                       counts: tuple[Any, list[str]] | None, tmp: Path) -> list[str]:
    """The client x class heatmap, or why there is none (PNG drawn in ``tmp``)."""
    if not counts:
        return ["<h2>Partition</h2>",
                "<p>The partition could not be recomputed (dataset not readable from here, or "
                "no data seed in the run folder) and the run folder holds no "
                "private/partition.json.</p>"]
    import numpy as np

    from privfedcal.data.partition_plots import plot_partition

    mat, classes = np.asarray(counts[0]), counts[1]
    title = f"{summary.get('dataset')}: {config.get('partition', '?')}, K={mat.shape[0]}"
    return ["<h2>Partition</h2>", H.figure(
        plot_partition(mat, tmp / "part.png", classes=classes or None, title=title),
        "partition heatmap", "training samples of each class (columns) held by each client "
        "(rows)")]


def _ledger_section(privacy: dict[str, Any]) -> list[str]:
    """The release ledger with the epsilon after each group, and the most-spent clients when
    the run accounted each client on its own."""
    rows = ledger(privacy)
    if not rows:
        return []
    parts = ["<h3>Release ledger</h3>", H.table(
        ["#", "release", "noise multiplier", "sample rate", "steps",
         "epsilon after it, all releases"],
        [[i + 1, r.get("label", ""), H.fmt_num(r["noise_multiplier"]),
          H.fmt_num(r.get("sample_rate")), r.get("steps", 1),
          H.fmt_fixed(r.get("epsilon_spent"), 3)]
         for i, r in enumerate(rows)], numeric=[True, False, True, True, True, True],
        table_id="ledger")]
    per_client = privacy.get("per_client_epsilon") or {}
    parts.append("<p>Each row is a group of equal releases as the accountant logged them; the "
                 "last column composes every release up to and including the row at delta "
                 f"{H.fmt_num(privacy.get('delta'))} ({H.esc(privacy.get('accountant', ''))}"
                 " accountant): the epsilon of a client that took part in all of them. "
                 + ("Each client is accounted over the releases it took part in only; the run "
                    "reports the worst-off client's epsilon, "
                    + H.checked(H.fmt_fixed(privacy.get("epsilon_spent"), 3),
                                "privacy.epsilon_spent", privacy.get("epsilon_spent"))
                    + ", at most the last row." if per_client else "") + "</p>")
    if per_client:
        worst = sorted(per_client.items(), key=lambda kv: -kv[1])
        shown = worst[:10]
        parts.append(H.table(
            ["client", "epsilon"], [[c, H.fmt_fixed(e, 3)] for c, e in shown],
            numeric=[True, True], table_id="per-client-epsilon"))
        if len(worst) > len(shown):
            parts.append(f"<p>{len(shown)} of {len(worst)} clients, largest epsilon first; "
                         f"the smallest is {worst[-1][1]:.3f}.</p>")
    return parts


def _privacy_section(summary: dict[str, Any]) -> list[str]:
    """The privacy statement (or the lack of one), the ledger, the assumptions, the other
    privacy settings, and the uploads the server rejected or the releases it skipped."""
    privacy = summary.get("privacy") or {}
    parts = ["<h2>Privacy</h2>"]
    if privacy.get("statement"):
        parts.append(f'<div class="statement">{H.esc(privacy["statement"])}</div>')
    elif summary.get("calibrator") not in (None, "none"):
        parts.append('<div class="flag">No protection: the server saw every client\'s '
                     "calibration upload in the clear.</div>")
    else:
        parts.append("<p>No calibration upload; model updates travel in the clear.</p>")
    parts += _ledger_section(privacy)
    if privacy.get("assumptions"):
        parts.append("<h3>Assumptions</h3><ul>" + "".join(
            f"<li>{H.esc(a)}</li>" for a in privacy["assumptions"]) + "</ul>")
    details = [(k, v) for k, v in privacy.items()
               if k not in ("releases", "statement", "noise_multipliers", "sample_rates",
                            "per_client_epsilon", "assumptions")]
    if details:
        parts.append("<h3>Settings</h3>")
        parts.append(H.table(["setting", "value"],
                             [[k, json.dumps(v) if isinstance(v, dict | list) else H.fmt_num(v)]
                              for k, v in _flatten(dict(details))]))
    for key, title in (("rejected_uploads", "Rejected uploads"),
                       ("skipped_releases", "Skipped releases")):
        if summary.get(key):
            parts.append(f"<h3>{title}</h3><ul>" + "".join(
                f"<li><code>{H.esc(json.dumps(x))}</code></li>" for x in summary[key]) + "</ul>")
    return parts


def _analysis_section(run_dir: Path) -> list[str]:
    """The PNGs and the class separability of ``privfedcal analyze``, when it ran."""
    analysis = load_json(run_dir / "analysis.json")
    if not analysis:
        return []
    parts = ["<h2>Analysis</h2><div class=\"grid2\">"]
    for name in analysis.get("plots", []):
        if (run_dir / name).is_file():
            parts.append(H.figure(run_dir / name, name, ANALYSIS_CAPTIONS.get(
                name, name.removesuffix(".png").replace("_", " "))))
    parts.append("</div>")
    sep = analysis.get("separability") or {}
    if "mean_sliced_wasserstein" in sep:
        parts.append(f"<p>Mean sliced Wasserstein distance between classes: "
                     f"{H.fmt_num(sep['mean_sliced_wasserstein'])}.</p>")
    return parts


def _configuration_section(config: dict[str, Any]) -> list[str]:
    """``config.json`` in two tables side by side (the versions go into the footer)."""
    cfg_rows = [[k, H.fmt_num(v) if not isinstance(v, list | dict) else json.dumps(v)]
                for k, v in _flatten(shown_config(config)) if not k.startswith("versions.")]
    half = (len(cfg_rows) + 1) // 2  # two columns side by side: half the scrolling
    return ["<h2>Configuration</h2>", '<div class="grid2">' + "".join(
        H.table(["setting", "value"], chunk) for chunk in (cfg_rows[:half], cfg_rows[half:])
        if chunk) + "</div>"]


def build_run_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``run_dir/report.html`` (or ``out``) and return its path."""
    run_dir = Path(run_dir)
    summary, config = load_run(run_dir)
    out = Path(out) if out else run_dir / "report.html"
    counts = _partition_counts(run_dir, config)
    classes = counts[1] if counts else []
    privacy = summary.get("privacy") or {}
    body = [_headline_cards(summary, classes)]
    body += [f'<div class="note">{H.esc(note)}</div>' for note in summary.get("notes") or []
             if note != privacy.get("statement")]
    with tempfile.TemporaryDirectory() as tmp:
        body += _accuracy_section(run_dir, summary, classes, Path(tmp))
        body += _partition_section(summary, config, counts, Path(tmp))
    body += _privacy_section(summary)
    body.append(dp_audit_section(run_dir))
    body += _analysis_section(run_dir)
    attacks = attack_sections(run_dir)
    if attacks:
        body.append("<h2>Attacks</h2>" + attacks)
    body += _configuration_section(config)
    versions = config.get("versions") or {}
    footer = "privfedcal report of " + str(run_dir.resolve()) + (
        " · " + ", ".join(f"{k} {v}" for k, v in versions.items()) if versions else "")
    title = f"{summary.get('method', '?')} on {summary.get('dataset', '?')}"
    subtitle = (f"{summary.get('rounds', '?')} rounds · model {summary.get('model', '?')} · "
                f"local {summary.get('local_method', '?')} · calibration "
                f"{summary.get('calibrator', 'none')} · {run_dir}")
    return H.write(out, H.page(title, subtitle, "\n".join(body), footer))
