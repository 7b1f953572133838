"""The run report's attack sections: the results of ``privfedcal attack`` (one
``attack-*`` folder each: tables, the most exposed target, each registered attack's own
section, figures) and of ``privfedcal audit dp`` (the distinguishing games' csv)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from privfedcal.report import html as H
from privfedcal.report.reading import load_json

ATTACK_CAPTIONS = {
    "reconstructions.png": "per target: true images (upper row) and the attack's "
                           "reconstructions (lower row, with their PSNR)",
    "classes.png": "class sets inferred from the uploads: shade = true count; dot = found, "
                   "x = false positive, open circle = missed",
    "disaggregation.png": "who is in each secure sum (rows: releases, and the public total "
                          "where one is used; * a client whose own value the sums determine) "
                          "and each scored client's relative error (filled: determined)",
}


def _mean(key: str, rs: list[dict[str, Any]]) -> float:
    vals = [r[key] for r in rs if isinstance(r.get(key), int | float)]
    return sum(vals) / len(vals) if vals else math.nan


def _best(rs: list[dict[str, Any]]) -> float:
    """Highest PSNR of any single image: ``psnr_best`` where records carry it, else the
    highest per-record mean."""
    found = [r.get("psnr_best", r.get("psnr")) for r in rs]
    vals = [v for v in found if isinstance(v, int | float)]
    return max(vals) if vals else math.nan


def _n_range(rs: list[dict[str, Any]]) -> str:
    ns = [r["n"] for r in rs if isinstance(r.get("n"), int)]
    if not ns:
        return "-"
    return str(min(ns)) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"


def _groups(recon: list[dict[str, Any]]) -> list[tuple[tuple[str, str], list[dict[str, Any]]]]:
    from privfedcal.attacks.release_attacks import target_order

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in recon:
        groups.setdefault((str(r.get("target")), str(r.get("view"))), []).append(r)
    order = {t: i for i, t in enumerate(target_order())}
    return sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1]))


def attack_sections(run_dir: Path) -> str:
    """One section per ``attack-*`` folder: a note if the attack was interrupted, the
    reconstruction and class-set tables, the registered attacks' sections, its figures."""
    parts = []
    for folder in sorted(p for p in run_dir.glob("attack-*") if p.is_dir()):
        records = load_json(folder / "attack.json") or []
        parts.append(f"<h3>{H.esc(folder.name)}</h3>")
        if isinstance(records, dict):  # an interrupted attack: its finished targets
            parts.append(f"<p>Partial: the attack was interrupted after "
                         f"{H.esc(records.get('targets_done'))} of "
                         f"{H.esc(records.get('targets_planned'))} targets (finish it with "
                         f"<code>privfedcal attack invert ... --resume</code>).</p>")
            records = records.get("records") or []
        recon = [r for r in records if "psnr" in r]
        if recon:
            parts.append(_reconstruction_table(recon))
            parts.append(_most_exposed(recon))
        classes = [r for r in records if "precision" in r and "psnr" not in r]
        if classes:
            parts.append(_class_set_table(classes))
        parts.append(_registered_sections(records))
        for png in sorted(folder.glob("*.png")):
            parts.append(H.figure(png, f"{folder.name}: {png.stem}", ATTACK_CAPTIONS.get(
                png.name, png.stem.replace("_", " ")), tall=True))
    return "".join(parts)


def _reconstruction_table(recon: list[dict[str, Any]]) -> str:
    """Reconstruction scores per (target, view): means over the records of each."""
    from privfedcal.attacks.reconstruction.scoring import VIEW_NAMES

    return H.table(
        ["target", "view", "targets", "n", "PSNR (dB)", "best PSNR", "prior PSNR",
         "SSIM", "feature cos", "nearest is true"],
        [[t, VIEW_NAMES.get(v, v), len(rs), _n_range(rs),
          *(H.fmt_fixed(f(rs), 3) for f in (
              lambda rs: _mean("psnr", rs), _best, lambda rs: _mean("prior_psnr", rs),
              lambda rs: _mean("ssim", rs), lambda rs: _mean("feature_cosine", rs),
              lambda rs: _mean("nearest_is_true", rs)))]
         for (t, v), rs in _groups(recon)],
        numeric=[False, False, True, True, True, True, True, True, True, True])


def _most_exposed(recon: list[dict[str, Any]]) -> str:
    """The record with the best single-image PSNR, among the real views."""
    # the hypothetical raw-feature baseline is no release: pick among real views
    real = [r for r in recon if r.get("view") != "hypothetical"] or recon
    best = max(real, key=lambda r: _best([r]) if math.isfinite(_best([r])) else -1e9)
    who = ("the aggregate of all clients" if best.get("client") is None
           else f"client {best['client']}")
    return (f'<p>Most exposed target: <b>{H.esc(best.get("target"))}</b> of '
            f'{H.esc(who)}, class {H.esc(best.get("class"))}'
            f' at {H.fmt_fixed(_best([best]), 2)} dB (data-free prior '
            f'{H.fmt_fixed(best.get("prior_psnr"), 2)} dB).</p>')


def _class_set_table(classes: list[dict[str, Any]]) -> str:
    """Class-set inference scores per (release, view): mean accuracy, precision, recall."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in classes:
        groups.setdefault((str(r.get("label")), str(r.get("view"))), []).append(r)
    return H.table(
        ["release", "view", "uploads", "accuracy", "precision", "recall"],
        [[lab, view, len(rs), *(H.fmt_fixed(_mean(k, rs), 3) for k in
                                ("accuracy", "precision", "recall"))]
         for (lab, view), rs in sorted(groups.items())],
        numeric=[False, False, True, True, True, True])


def _registered_sections(records: list[dict[str, Any]]) -> str:
    """The section of each registered attack that has one (``ReleaseAttack.report``), on
    its records (those of its ``targets``): a table and paragraphs after it."""
    from privfedcal.attacks.release_attacks import registered

    parts = []
    for attack in registered():
        mine = [r for r in records if r.get("target") in attack.targets]
        shown = attack.report(mine) if mine and attack.report is not None else None
        if shown is None:
            continue
        parts.append(H.table(list(shown.columns), shown.rows,
                             numeric=list(shown.numeric) or None,
                             table_id=shown.table_id or "")
                     + "".join(f"<p>{H.esc(note)}</p>" for note in shown.notes))
    return "".join(parts)


def dp_audit_section(run_dir: Path) -> str:
    """The table and plot of ``privfedcal audit dp`` when the folder holds its csv."""
    from privfedcal.attacks.distinguishing.games import CSV_NAME, read_csv

    path = run_dir / CSV_NAME
    if not path.is_file():
        return ""
    rows = read_csv(path)
    parts = ["<h3>Empirical privacy audit (distinguishing games)</h3>", H.table(
        ["channel", "claimed epsilon", "delta", "empirical lower bound", "confidence",
         "trials", "canary", "verdict"],
        [[r["channel"], H.fmt_fixed(r["claimed_eps"], 3), H.fmt_num(r["delta"]),
          H.fmt_fixed(r["eps_lower"], 3), H.fmt_num(r["confidence"]), H.fmt_num(int(r["trials"])),
          r["canary"], ("claim refuted" if r["eps_lower"] > r["claimed_eps"] else
                        "consistent with the claim")
          + (" (stopped by its time budget)" if r.get("stopped") else "")] for r in rows],
        numeric=[False, True, True, True, True, True, False, False], table_id="dp-audit")]
    parts.append("<p>A lower bound above the claimed epsilon shows, at the stated confidence, "
                 "that the channel is not as private as claimed; one below it proves nothing "
                 "about the claim (docs/privacy.md).</p>")
    with tempfile.TemporaryDirectory() as tmp:
        from privfedcal.attacks.distinguishing.games import plot

        png = plot(rows, Path(tmp) / "dp_audit.png")
        parts.append(H.figure(png, "claimed vs empirical epsilon", "per channel: the epsilon "
                              "the run claims (outline) and the audit's lower bound (filled)"))
    return "".join(parts)
