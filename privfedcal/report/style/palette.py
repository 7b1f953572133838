"""The colours of every privfedcal plot, importable without matplotlib (``accuracy.png`` is
drawn with Pillow at the end of every run; the other plots use plotstyle.py)."""

from __future__ import annotations

#: Okabe & Ito (2008), ordered so that neighbours differ in hue and lightness
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000",
           "#F0E442")


def rgb(index: int) -> tuple[int, int, int]:
    """The ``index``-th palette colour as an (r, g, b) tuple of 0..255."""
    h = PALETTE[index % len(PALETTE)].lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)
