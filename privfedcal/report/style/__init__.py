"""The look every figure shares: colours (palette.py) and matplotlib styling (plotstyle.py)."""
