"""``privfedcal report`` / ``compare`` and ``train --report`` end to end; bad input is one
line and exit 2."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from cli_helpers import assert_usage_error

from privfedcal.cli.main import main
from privfedcal.cli.partition_command import class_label
from privfedcal.federation.runlog import read_metrics_csv


def checked_values(page: str) -> dict[str, str]:
    """The numbers a report marks ``data-check`` (they mirror summary.json's keys)."""
    return dict(re.findall(r'data-check="([^"]+)"[^>]*>([^<]*)<', page))

FAST = ["--clients", "4", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--no-transcript"]


def test_train_report_then_report_and_compare(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    main(["train", *FAST, "--out", str(a), "--report"])
    sa = json.loads((a / "summary.json").read_text())
    first = (a / "report.html").read_text()
    assert checked_values(first)["accuracy"] == f"{100 * sa['accuracy']:.2f} %"
    assert [r["round"] for r in read_metrics_csv(a / "metrics.csv")] == [1.0, 2.0]
    (a / "report.html").unlink()
    main(["report", str(a)])
    # the command rebuilds the same page from the run folder
    assert checked_values((a / "report.html").read_text()) == checked_values(first)
    main(["train", *FAST, "--seed", "1", "--out", str(b)])
    capsys.readouterr()
    main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
    out = capsys.readouterr()
    assert "privfedcal compare" in out.out and "warning" not in out.err
    rows = list(csv.DictReader((tmp_path / "cmp" / "compare.csv").open()))
    # no calibrator: the final accuracy is the one before calibration, none after
    assert float(rows[0]["accuracy_before"]) == sa["accuracy"]
    assert rows[0]["accuracy_after"] == ""
    assert float(rows[0]["bytes"]) == sa["calibration_upload_bytes"] + sa["model_update_bytes"]
    sb = json.loads((b / "summary.json").read_text())
    assert float(rows[1]["accuracy_before"]) == sb["accuracy"]
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert f"{100 * sa['accuracy']:.2f}" in page and f"{100 * sb['accuracy']:.2f}" in page


def test_report_of_an_audit_folder(tmp_path, capsys):
    (tmp_path / "audit.csv").write_text("method,eps,secagg,accuracy,psnr\nccvr,inf,off,0.8,14\n")
    main(["report", str(tmp_path), "--out", str(tmp_path / "page.html")])
    assert "privacy audit" in (tmp_path / "page.html").read_text()


def test_report_out_is_a_page_or_a_folder_and_refused_in_one_line(tmp_path, capsys):
    """``--out`` ending in .html is the page; any other ``--out`` is a folder that gets
    report.html; an ``--out`` that cannot be written is a usage error (exit 2), not exit 1."""
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "audit.csv").write_text("method,eps,secagg,accuracy,psnr\nccvr,inf,off,0.8,14\n")
    main(["report", str(audit), "--out", str(tmp_path / "pages")])
    assert "privacy audit" in (tmp_path / "pages" / "report.html").read_text()
    main(["report", str(audit), "--out", str(tmp_path / "pages")])  # a report is re-written
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_usage_error(["report", str(audit), "--out", str(blocker / "page.html")], capsys,
                       "cannot write to --out", "not a folder")
    (tmp_path / "x.html").mkdir()
    assert_usage_error(["report", str(audit), "--out", str(tmp_path / "x.html")], capsys,
                       "is a folder")
    if Path("/proc").is_dir():  # refuses new entries even to root
        assert_usage_error(["report", str(audit), "--out", "/proc/privfedcal.html"], capsys,
                           "cannot write to --out")


def test_bad_input(tmp_path, capsys):
    assert_usage_error(["report", str(tmp_path / "missing")], capsys, "not a folder")
    assert_usage_error(["report", str(tmp_path)], capsys, "neither a run")
    assert_usage_error(["compare", str(tmp_path)], capsys, "no summary.json")
    assert_usage_error(["train", *FAST, "--log", "wandb", "--out", str(tmp_path / "r")], capsys,
                       "--log takes tensorboard")


def test_partition_table_class_label():
    assert class_label(["0", "1", "2"], 2) == "#2"
    assert class_label(["apple", "bee"], 1) == "bee (#1)"
