"""report.html of a real run folder: every section the folder supports, numbers equal to
summary.json, and graceful pages for folders that hold less."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from privfedcal.errors import UsageError
from privfedcal.report.run_report import build_run_report


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
    # an interrupted attack's attack.json is an object: its finished targets are shown
    record = json.loads((attack / "attack.json").read_text())[0]
    (attack / "attack.json").write_text(json.dumps({
        "partial": True, "targets_done": 1, "targets_planned": 4, "settings": {},
        "done": [], "records": [{**record, "psnr": 17.25}]}))
    page = build_run_report(full).read_text()
    assert "17.250" in page and "after 1 of 4 targets" in page


def test_unfinished_or_missing_folder_is_a_usage_error(tmp_path: Path):
    with pytest.raises(UsageError, match="not a folder"):
        build_run_report(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="has not finished"):
        build_run_report(tmp_path)
    (tmp_path / "summary.json").write_text("{broken")
    with pytest.raises(UsageError, match="not valid JSON"):
        build_run_report(tmp_path)


def test_dp_audit_table_and_plot_when_the_folder_holds_one(run_dir: Path, tmp_path: Path):
    from privfedcal.attacks.distinguishing.games import write_csv

    full = tmp_path / "audited"
    shutil.copytree(run_dir, full)
    before = build_run_report(full).read_text()
    assert "dp-audit" not in before
    write_csv([{"channel": "ccvr-stats", "claimed_eps": 7.99, "delta": 1e-5, "eps_lower": 4.47,
                "confidence": 0.95, "trials": 400000, "canary": "one feature"},
               {"channel": "creff-grad", "claimed_eps": 1.0, "delta": 1e-5, "eps_lower": 7.9,
                "confidence": 0.95, "trials": 40000, "canary": "<b>x</b>"},
               {"channel": "dp-sgd", "claimed_eps": 1.0, "delta": 1e-5, "eps_lower": 0.0,
                "confidence": 0.95, "trials": 4, "canary": "y", "stopped": "budget"}],
              full / "dp_audit.csv")
    page = build_run_report(full).read_text()
    table = page.split('id="dp-audit"')[1].split("</table>")[0]
    assert "7.990" in table and "4.470" in table and "400,000" in table
    assert table.count("claim refuted") == 1 and "consistent with the claim" in table
    assert table.count("stopped by its time budget") == 1    # the dp-sgd row only
    assert "&lt;b&gt;x&lt;/b&gt;" in table                  # the canary text is escaped
    assert page.count('src="data:image/png;base64,') == before.count(
        'src="data:image/png;base64,') + 1


def test_configuration_table_shows_the_calibrator_that_ran(run_dir: Path):
    """The fixture trains ``--method ccvr`` (fedavg + ccvr): config.json keeps calibrate
    'none', the table shows ccvr."""
    from privfedcal.report.run_report import shown_config

    assert json.loads((run_dir / "config.json").read_text())["calibrate"] == "none"
    page = build_run_report(run_dir).read_text()
    config = page.split(">Configuration<")[1]
    cells = dict(re.findall(r"<tr><td[^>]*>([^<]*)</td><td[^>]*>([^<]*)</td></tr>", config))
    assert cells["calibrate"] == "ccvr (--method ccvr = fedavg + ccvr)"
    assert cells["method"] == "ccvr"
    for cfg in ({"method": "fedavg", "calibrate": "none"},
                {"method": "fedprox", "calibrate": "creff"}, {"method": "ccvr",
                                                            "calibrate": "ccvr"}):
        assert shown_config(cfg) == cfg
