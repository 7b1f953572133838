"""attacks/reconstruction/leakage_sweep.py: the settings grid, row files and refusals kept as rows (the full
train-and-attack sweep runs in tests/cli)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from privfedcal.attacks.reconstruction.leakage_sweep import (
    COLUMNS,
    AuditConfig,
    Setting,
    plot_audit,
    run_setting,
    write_csv,
)
from privfedcal.errors import UsageError


def test_setting_names_and_the_unprotected_baseline():
    assert Setting("ccvr", math.inf, False).name == "ccvr-epsinf-secagg-off"
    assert Setting("creff", 2.0, True).name == "creff-eps2-secagg-on"
    assert Setting("ccvr", 0.5, False).name == "ccvr-eps0.5-secagg-off"
    assert Setting("ccvr", math.inf, False).unprotected
    assert not Setting("ccvr", math.inf, True).unprotected
    assert not Setting("ccvr", 8.0, False).unprotected


def test_grid_order_and_validation():
    cfg = AuditConfig(eps=(1.0, math.inf), secagg=(False, True), methods=("ccvr", "creff"))
    assert [s.name for s in cfg.settings()] == [
        "ccvr-eps1-secagg-off", "ccvr-epsinf-secagg-off", "ccvr-eps1-secagg-on",
        "ccvr-epsinf-secagg-on", "creff-eps1-secagg-off", "creff-epsinf-secagg-off",
        "creff-eps1-secagg-on", "creff-epsinf-secagg-on"]
    assert len(AuditConfig().settings()) == 5 * 2 * 2
    with pytest.raises(UsageError, match="at least one"):
        AuditConfig(eps=())
    with pytest.raises(UsageError, match="> 0"):
        AuditConfig(eps=(0.0,))
    with pytest.raises(UsageError, match="> 0"):
        AuditConfig(eps=(math.nan,))
    with pytest.raises(UsageError, match="attack-clients"):
        AuditConfig(attack_clients=0)


def test_a_method_without_calibration_upload_is_a_row_with_a_note(tmp_path):
    row = run_setting(Setting("fedavg", 1.0, False), AuditConfig(), tmp_path)
    assert row == {"method": "fedavg", "eps": 1.0, "secagg": False,
                   "note": "skipped: fedavg uploads no calibration payload (nothing to attack)"}
    assert not (tmp_path / "runs").exists()


def test_csv_cells(tmp_path):
    rows = [{"method": "ccvr", "eps": math.inf, "secagg": True, "accuracy": 0.123456789,
             "psnr_max": math.nan, "nearest_of_worst": False, "worst_client": None,
             "targets": 3, "note": "x", "ignored": 1},
            {"method": "fedavg", "eps": 1.0, "secagg": False, "note": "skipped"}]
    path = write_csv(rows, tmp_path / "audit.csv")
    with path.open(newline="") as f:
        got, skipped = list(csv.DictReader(f))
    assert list(got) == list(COLUMNS)
    assert {k: got[k] for k in ("method", "eps", "secagg", "accuracy", "psnr_max",
                                "nearest_of_worst", "worst_client", "targets", "note",
                                "ssim")} == {
        "method": "ccvr", "eps": "inf", "secagg": "on", "accuracy": "0.123457",
        "psnr_max": "", "nearest_of_worst": "no", "worst_client": "", "targets": "3",
        "note": "x", "ssim": ""}
    # the column says something in every row: n/a where nothing was scored
    assert skipped["nearest_of_worst"] == "n/a" and skipped["note"] == "skipped"


def test_plot_writes_a_png_and_skips_unattacked_rows(tmp_path):
    rows = [{"method": "ccvr", "eps": math.inf, "secagg": False, "accuracy": 0.9,
             "psnr_max": 20.0, "psnr": 15.0, "prior_psnr_max": 12.0,
             "class_inference_accuracy": 1.0},
            {"method": "ccvr", "eps": 1.0, "secagg": True, "accuracy": 0.8,
             "psnr_max": math.nan, "class_inference_accuracy": 0.5},
            {"method": "creff", "eps": 1.0, "secagg": False, "note": "skipped: budget"}]
    path = plot_audit(rows, tmp_path / "audit.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_audit_trains_with_its_attacks_calibration_options(tmp_path):
    """CReFF's runs take the gradient attack's ``audit_params`` (release_attacks.py)."""
    row = run_setting(Setting("creff", math.inf, False),
                      AuditConfig(steps=1, restarts=1, rounds=1, clients=3, max_n=8), tmp_path)
    assert row["note"] == "" and 0 <= row["accuracy"] <= 1
    config = json.loads((tmp_path / "runs" / "creff-epsinf-secagg-off" / "config.json")
                        .read_text())
    assert config["calibration_params"] == {"match_steps": 50, "retrain_steps": 100}
