"""The report pages in a real browser (Debian's ``chromium``, headless): every image decodes,
the numbers a reader sees equal summary.json, nothing is fetched from the network, and a
screenshot is saved (``$PRIVFEDCAL_SCREENSHOTS`` keeps them; default: the test's tmp dir).

Run with ``pytest -m browser``; skipped where no chromium is installed (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]
UNITS = {"%": 0.01, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "s": 1}


def chromium(page: Path, tmp_path: Path, *args: str) -> str:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def loaded_dom(page: Path, tmp_path: Path) -> str:
    """The DOM after the page's load handler ran (virtual time lets it finish)."""
    dom = chromium(page, tmp_path, "--virtual-time-budget=10000", "--dump-dom")
    assert 'data-ready="yes"' in dom, "the page's load handler did not run"
    return dom


def screenshot(page: Path, tmp_path: Path, name: str, height: int = 2400) -> Path:
    keep = Path(os.environ.get("PRIVFEDCAL_SCREENSHOTS", tmp_path))
    keep.mkdir(parents=True, exist_ok=True)
    out = keep / f"{name}.png"
    chromium(page, tmp_path, f"--window-size=1280,{height}", f"--screenshot={out}",
             "--virtual-time-budget=10000")
    from PIL import Image

    with Image.open(out) as im:
        assert im.size == (1280, height)
        colours = im.convert("RGB").resize((160, 300)).getcolors(maxcolors=100_000)
    assert colours is not None and len(colours) > 50, "the screenshot is (nearly) blank"
    return out


def assert_images_loaded(dom: str, expected: int) -> None:
    images = re.findall(r"<img\b[^>]*>", dom)
    assert len(images) == expected
    assert all('data-loaded="yes"' in im for im in images), [
        im[:120] for im in images if 'data-loaded="yes"' not in im]
    assert f'data-images="{expected} total, 0 broken"' in dom
    assert not re.search(r'(src|href)="https?://', dom)


def number(text: str) -> tuple[float, float, int]:
    """(value shown, its unit, decimals shown) of a displayed number like '12.60 MiB'."""
    m = re.fullmatch(r"\s*([-0-9.,]+)\s*(%|B|KiB|MiB|GiB|s)?\s*", text)
    assert m, f"not a number: {text!r}"
    digits = m.group(1).replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return float(digits), UNITS.get(m.group(2) or "", 1), decimals


def expected(summary: dict, key: str) -> float:
    if key.startswith("min:"):
        return min(v for v in summary[key[4:]] if v is not None)
    value = summary
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return float(value)


def test_run_report_in_chromium(run_dir, tmp_path):
    from privfedcal.report.run_report import build_run_report

    page = build_run_report(run_dir)
    dom = loaded_dom(page, tmp_path)
    assert_images_loaded(dom, 4)
    summary = json.loads((run_dir / "summary.json").read_text())
    shown = re.findall(r'<span data-check="([^"]+)"[^>]*>([^<]*)</span>', dom)
    keys = {k for k, _ in shown}
    assert {"accuracy", "accuracy_before_calibration", "min:per_class_accuracy",
            "privacy.epsilon_spent", "calibration_upload_bytes", "model_update_bytes",
            "wall_seconds"} <= keys
    for key, text in shown:
        got, unit, decimals = number(text)
        # what is shown must be summary.json's value rounded to the decimals shown
        want = expected(summary, key) / unit
        assert abs(got - want) <= 0.5 * 10**-decimals + 1e-9, (key, text, want)
    screenshot(page, tmp_path, "run-report", height=3000)


def test_compare_and_audit_pages_in_chromium(run_dir, audit_dir, tmp_path):
    from privfedcal.report.audit_report import build_audit_report
    from privfedcal.report.comparison import collect, write_html

    rows, warnings = collect([run_dir, run_dir])
    page = write_html(rows, warnings, tmp_path / "compare.html")
    dom = loaded_dom(page, tmp_path)
    assert_images_loaded(dom, 1)
    summary = json.loads((run_dir / "summary.json").read_text())
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", dom.split('id="compare"')[1])
    assert f"{100 * summary['accuracy']:.2f} %" in cells
    screenshot(page, tmp_path, "compare", height=1100)
    page = build_audit_report(audit_dir)
    assert_images_loaded(loaded_dom(page, tmp_path), 1)
    screenshot(page, tmp_path, "audit-report", height=1600)
