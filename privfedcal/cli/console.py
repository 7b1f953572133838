"""The consoles every command prints through: on a terminal they fit its width; piped or
redirected they are wide enough that no table is truncated or wrapped."""

from __future__ import annotations

import sys

from rich.console import Console


def _width(stream) -> int | None:
    """None (the terminal's width) on a terminal, else wide enough never to truncate."""
    try:
        return None if stream.isatty() else 10_000
    except (AttributeError, ValueError):
        return 10_000


console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))
