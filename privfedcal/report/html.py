"""Self-contained HTML pages: inline CSS (screen and print), images as base64 PNG data URIs,
a Content-Security-Policy that forbids every network fetch, and a small inline script that
records in the DOM whether each image decoded (``data-loaded``), which the browser test reads.

Numbers that come from a run's ``summary.json`` carry ``data-check="dotted.key"`` (and
``data-scale`` when shown as a percentage) so that a test can compare what is displayed
with the file.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
       "script-src 'unsafe-inline'")

CSS = """
:root { --fg: #1b1f24; --muted: #5b6470; --line: #d6dae0; --bg: #ffffff; --panel: #f5f7f9;
        --accent: #0072B2; --warn: #D55E00; }
* { box-sizing: border-box; }
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--fg); background: var(--bg); margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 1.6em; margin: 0 0 4px; }
h2 { font-size: 1.2em; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 2px solid var(--line); }
h3 { font-size: 1.02em; margin: 18px 0 6px; }
.sub { color: var(--muted); margin: 0 0 16px; word-break: break-all; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(140px, 1fr)); gap: 10px; }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; }
.card .label { color: var(--muted); font-size: 0.82em; text-transform: uppercase; letter-spacing: .03em; }
.card .value { font-size: 1.35em; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .hint { color: var(--muted); font-size: 0.8em; }
table { border-collapse: collapse; margin: 8px 0 12px; font-variant-numeric: tabular-nums; font-size: 0.92em; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: var(--panel); font-weight: 600; }
td.num, th.num { text-align: right; }
td.num { white-space: nowrap; }
.scroll { overflow-x: auto; max-width: 100%; }
figure { margin: 10px 0 16px; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; background: #fff; }
.tall { max-height: 85vh; overflow-y: auto; border: 1px solid var(--line); border-radius: 4px; }
.tall figure { margin: 0; }
figcaption { color: var(--muted); font-size: 0.88em; margin-top: 4px; }
.grid2 { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 16px; }
.statement { background: #eef5fb; border-left: 4px solid var(--accent); padding: 8px 12px; margin: 8px 0; }
.flag, .note { border-left: 4px solid var(--warn); background: #fdf1ea; padding: 6px 12px; margin: 6px 0; }
.note { border-left-color: #E69F00; background: #fdf7e8; }
tr.flagged td { background: #fdf1ea; }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: .9em; }
footer { color: var(--muted); font-size: .82em; margin-top: 36px; border-top: 1px solid var(--line); padding-top: 8px; }
@media (max-width: 700px) { main { padding: 12px; } .grid2 { grid-template-columns: 1fr; } }
@media print {
  @page { size: A4; margin: 14mm; }
  body { font-size: 10.5pt; }
  main { max-width: none; padding: 0; }
  h2 { break-after: avoid; page-break-after: avoid; }
  figure, table, .card, .statement { break-inside: avoid; page-break-inside: avoid; }
  .grid2 { display: block; }
  .scroll, .tall { overflow: visible; max-height: none; border: none; }
  figure img { max-height: 120mm; border: none; }
  .card { border-color: #999; }
  a { color: inherit; text-decoration: none; }
}
"""

# Marks every image's decode state on the <img> and a summary on <body>: a browser test (or a
# reader) can see at a glance whether any figure failed to load.
SCRIPT = """
window.addEventListener('load', function () {
  var imgs = document.querySelectorAll('img'), bad = 0;
  imgs.forEach(function (im) {
    var ok = im.complete && im.naturalWidth > 0;
    im.setAttribute('data-loaded', ok ? 'yes' : 'no');
    if (!ok) { bad += 1; }
  });
  document.body.setAttribute('data-images', imgs.length + ' total, ' + bad + ' broken');
  document.body.setAttribute('data-ready', 'yes');
});
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt_num(value: Any, digits: int = 4) -> str:
    """A number for a table cell: '-' for missing/NaN, 'inf', thousands separators for ints."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if abs(value) >= 1000:
            return f"{value:,.1f}"
        return f"{value:.{digits}g}"
    return str(value)


def fmt_fixed(value: Any, digits: int = 2) -> str:
    """Fixed decimals for columns of comparable numbers ('-' when missing or not finite)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "-" if value is None or isinstance(value, float) else str(value)
    return f"{value:.{digits}f}"


def fmt_pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else \
        f"{100 * value:.{digits}f} %"


def fmt_bytes(n: float | int | None) -> str:
    """Bytes in binary units with the exact count kept for the test (``1.2 MiB``)."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def checked(text: str, key: str, value: Any = None, scale: float | None = None) -> str:
    """A span showing ``text`` that a test can match against ``summary.json``'s ``key``."""
    attrs = f' data-check="{esc(key)}"'
    if scale is not None:
        attrs += f' data-scale="{scale:g}"'
    if value is not None:
        attrs += f' data-value="{esc(value)}"'
    return f"<span{attrs}>{esc(text)}</span>"


def png_data_uri(source: Path | bytes) -> str:
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def figure(source: Path | bytes, alt: str, caption: str = "", *, tall: bool = False) -> str:
    """An embedded PNG; ``tall`` ones scroll inside a box on screen (whole in print)."""
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    img = f'<img src="{png_data_uri(source)}" alt="{esc(alt)}" loading="eager">'
    if tall:
        return f'<figure><div class="tall">{img}</div>{cap}</figure>'
    return f"<figure>{img}{cap}</figure>"


def card(label: str, value_html: str, hint: str = "") -> str:
    h = f'<div class="hint">{esc(hint)}</div>' if hint else ""
    return (f'<div class="card"><div class="label">{esc(label)}</div>'
            f'<div class="value">{value_html}</div>{h}</div>')


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, numeric: Sequence[bool] | None
          = None, raw: bool = False, row_classes: Sequence[str] | None = None,
          table_id: str = "") -> str:
    """An HTML table; cells are escaped unless ``raw`` (then they are trusted HTML)."""
    numeric = list(numeric) if numeric is not None else [False] * len(headers)
    head = "".join(f'<th class="{"num" if n else ""}">{esc(h)}</th>'
                   for h, n in zip(headers, numeric, strict=True))
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(
            f'<td class="{"num" if n else ""}">{c if raw else esc(c)}</td>'
            for c, n in zip(row, numeric, strict=True))
        body.append(f"<tr{cls}>{cells}</tr>")
    tid = f' id="{esc(table_id)}"' if table_id else ""
    return (f'<div class="scroll"><table{tid}><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def page(title: str, subtitle: str, body: str, footer: str = "") -> str:
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>{esc(title)}</title>
<style>{CSS}</style>
</head>
<body>
<main>
<h1>{esc(title)}</h1>
<p class="sub">{esc(subtitle)}</p>
{body}
<footer>{esc(footer)}</footer>
</main>
<script>{SCRIPT}</script>
</body>
</html>
"""


def write(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
