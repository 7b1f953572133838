"""The audit page reads whatever columns audit.csv has; worst case is drawn when present."""

from __future__ import annotations

from privfedcal.report.audit import build_audit_report, read_audit, worst_column


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
