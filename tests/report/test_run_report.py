"""report.html of a real run folder: every section the folder supports, numbers equal to
summary.json, and graceful pages for folders that hold less."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from privfedcal.errors import UsageError
from privfedcal.report.run import build_run_report


def checked_values(page: str) -> dict[str, str]:
    return dict(re.findall(r'data-check="([^"]+)"[^>]*>([^<]*)<', page))


def test_run_report_shows_what_the_run_holds(run_dir: Path):
    page = build_run_report(run_dir).read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    shown = checked_values(page)
    assert shown["accuracy"] == f"{100 * summary['accuracy']:.2f} %"
    assert shown["accuracy_before_calibration"] == \
        f"{100 * summary['accuracy_before_calibration']:.2f} %"
    worst = min(v for v in summary["per_class_accuracy"] if v is not None)
    assert shown["min:per_class_accuracy"] == f"{100 * worst:.2f} %"
    assert shown["privacy.epsilon_spent"] == f"{summary['privacy']['epsilon_spent']:.3f}"
    # the ledger's last row composes every release: no client can have spent more
    ledger = page.split('id="ledger"')[1].split("</table>")[0]
    last = float(re.findall(r'<td class="num">([0-9.]+)</td></tr>', ledger)[-1])
    assert last >= summary["privacy"]["epsilon_spent"] - 5e-4
    for heading in ("Accuracy", "Per-class accuracy", "Partition", "Privacy", "Release ledger",
                    "Configuration"):
        assert f">{heading}<" in page, heading
    # accuracy, loss, per-class and partition plots are embedded
    assert page.count('src="data:image/png;base64,') == 4
    assert summary["privacy"]["statement"] in page.replace("&#x27;", "'")
    assert "Analysis" not in page and "Attacks" not in page  # the run has neither


def test_report_of_a_bare_folder_and_extras(run_dir: Path, tmp_path: Path):
    bare = tmp_path / "bare"
    bare.mkdir()
    summary = {"method": "fedavg", "dataset": "digits", "accuracy": 0.5,
               "per_class_accuracy": [0.5, None]}
    (bare / "summary.json").write_text(json.dumps(summary))
    page = build_run_report(bare).read_text()
    assert "50.00 %" in page and "could not be recomputed" in page
    # analysis and attack folders are picked up when present
    full = tmp_path / "full"
    shutil.copytree(run_dir, full)
    png = (run_dir / "report.html").read_text()  # any PNG will do: reuse the accuracy plot
    import base64

    data = base64.b64decode(re.search(r'base64,([^"]+)"', png).group(1))
    (full / "cka.png").write_bytes(data)
    (full / "analysis.json").write_text(json.dumps({"plots": ["cka.png", "missing.png"]}))
    attack = full / "attack-stats"
    attack.mkdir()
    (attack / "reconstructions.png").write_bytes(data)
    (attack / "attack.json").write_text(json.dumps([
        {"target": "class-stats", "view": "aggregate", "client": None, "class": 3, "n": 7,
         "psnr": 13.5, "prior_psnr": 11.0, "ssim": 0.2, "feature_cosine": 0.4,
         "nearest_is_true": 0.0}]))
    page = build_run_report(full).read_text()
    assert ">Analysis<" in page and ">Attacks<" in page and "13.500" in page
    assert page.count('src="data:image/png;base64,') == 6


def test_unfinished_or_missing_folder_is_a_usage_error(tmp_path: Path):
    with pytest.raises(UsageError, match="not a folder"):
        build_run_report(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="has not finished"):
        build_run_report(tmp_path)
    (tmp_path / "summary.json").write_text("{broken")
    with pytest.raises(UsageError, match="not valid JSON"):
        build_run_report(tmp_path)
