"""The page helpers: formatting, escaping, self-containedness."""

from __future__ import annotations

import base64
import re

from privfedcal.report import html as H

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 20


def test_numbers_format_as_a_reader_expects():
    assert H.fmt_pct(0.87584) == "87.58 %"
    assert H.fmt_pct(None) == "-"
    assert H.fmt_bytes(512) == "512 B"
    assert H.fmt_bytes(13_207_396) == "12.60 MiB"  # 13207396 / 2**20 = 12.5956
    assert H.fmt_num(float("inf")) == "inf"
    assert H.fmt_num(float("nan")) == "-"
    assert H.fmt_num(6_099_120) == "6,099,120"
    assert H.fmt_num(True) == "on"
    assert H.fmt_num(0.0399113) == "0.03991"


def test_page_is_self_contained_and_escaped():
    body = H.figure(PNG, "a <b>", "cap & co") + H.table(["x"], [["<script>"]])
    page = H.page("t <1>", "sub", body)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "&lt;script&gt;" in page and "t &lt;1&gt;" in page
    uri = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(uri) == PNG
    assert "@media print" in page


def test_checked_span_carries_key_and_scale():
    span = H.checked("87.58 %", "accuracy", 0.8758, 100)
    assert 'data-check="accuracy"' in span and 'data-scale="100"' in span
    assert ">87.58 %<" in span
