"""The audit page reads whatever columns audit.csv has; worst case is drawn when present."""

from __future__ import annotations

from privfedcal.report.audit_report import build_audit_report, read_audit, worst_column


def test_audit_page_with_worst_case_columns(audit_dir):
    columns, rows = read_audit(audit_dir)
    assert worst_column("psnr", columns) == "psnr_max" and worst_column("ssim", columns) is None
    assert rows[1]["secagg"] is False and rows[2]["secagg"] is True
    page = build_audit_report(audit_dir).read_text()
    assert page.count('src="data:image/png;base64,') == 1  # the trade-off plot
    assert "19.50 dB" in page  # the highest worst-case PSNR card
    section = page.split("Most exposed targets per setting")[1]
    assert "ccvr-epsinf-secagg-off" in section
    # most exposed first: 19.5 before 15.0 before 12.0, and only three targets
    assert section.index("19.500") < section.index("15.000") < section.index("12.000")
    assert "11.000" not in section
    assert "skipped: budget cannot be met" in page


def test_audit_page_without_worst_case_columns(audit_dir):
    csv_path = audit_dir / "audit.csv"
    lines = [line.split(",") for line in csv_path.read_text().splitlines()]
    drop = lines[0].index("psnr_max")
    csv_path.write_text("\n".join(",".join(c for i, c in enumerate(line) if i != drop)
                                  for line in lines) + "\n")
    columns, _ = read_audit(audit_dir)
    assert worst_column("psnr", columns) is None
    page = build_audit_report(audit_dir).read_text()
    assert "14.25 dB" in page and page.count("data:image/png;base64,") == 1


def test_audit_page_with_worst_case_identity_columns(tmp_path):
    """Audits that name the most exposed client/class/target per setting and records that
    carry each target's best single-image PSNR (psnr_best)."""
    import json

    d = tmp_path / "audit"
    (d / "runs" / "ccvr-eps2-secagg-off").mkdir(parents=True)
    (d / "audit.csv").write_text(
        "method,eps,secagg,accuracy,psnr_max,nearest_of_worst,worst_client,worst_class,"
        "worst_target,prior_psnr_max,psnr,ssim,converged,targets,note\n"
        "ccvr,2,off,0.7,16.5,True,3,7,class-stats,12.0,11.0,0.2,True,2,\n")
    records = [{"target": "class-stats", "client": 3, "class": 7, "n": 4, "psnr": 11.0,
                "psnr_best": 16.5}, {"target": "class-stats", "client": 1, "class": 2, "n": 4,
                                     "psnr": 12.0, "psnr_best": 13.0}]
    (d / "runs" / "ccvr-eps2-secagg-off" / "attack.json").write_text(json.dumps(records))
    page = build_audit_report(d).read_text()
    assert ">worst client<" in page and ">PSNR worst<" in page
    assert "16.50 dB" in page
    section = page.split("Most exposed targets per setting")[1]
    # ranked by the best single image (16.5 of client 3) although its mean is lower
    assert section.index("16.500") < section.index("13.000")


def test_audit_page_tables_fit_the_page(tmp_path):
    """Every column of a full audit.csv is on the page, in tables of at most TABLE_COLUMNS
    columns (the single 20-column table needed horizontal scrolling): the worst case, the
    means, and what the run's secure sums determine."""
    import re

    from privfedcal.attacks.reconstruction.leakage_sweep import COLUMNS
    from privfedcal.report.audit_report import TABLE_COLUMNS

    d = tmp_path / "audit"
    d.mkdir()
    row = {c: "1" for c in COLUMNS} | {"method": "ccvr", "secagg": "off", "note": "",
                                        "worst_target": "class-stats",
                                        "nearest_of_worst": "yes"}
    (d / "audit.csv").write_text(",".join(COLUMNS) + "\n"
                                 + ",".join(row[c] for c in COLUMNS) + "\n")
    page = build_audit_report(d).read_text()
    settings = page.split("<h2>Settings</h2>")[1].split("<h2>")[0]
    heads = [re.findall(r"<th[^>]*>([^<]*)</th>", t) for t in settings.split("<table")[1:]]
    assert len(heads) == 3 and all(len(h) <= TABLE_COLUMNS for h in heads)
    from privfedcal.report.audit_report import HEADERS

    shown = {h for hs in heads for h in hs}
    assert {HEADERS.get(c, c.replace("_", " ")) for c in COLUMNS if c != "note"} <= shown
