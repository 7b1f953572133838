"""The consoles every command prints through, and the progress of long commands.

On a terminal the consoles fit its width; piped or redirected, lines are never wrapped and
tables (``print_table``) fold into 80 columns. Progress (``Reporter``) is a bar on a terminal; piped,
redirected or in a batch job it is one line on stderr per stage and at most one per
``every`` seconds within a stage, so that a log shows the command is alive. ``--quiet``
silences both; results and errors are printed either way.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


def _width(stream) -> int | None:
    """None (the terminal's width) on a terminal, else wide enough never to truncate."""
    try:
        return None if stream.isatty() else 10_000
    except (AttributeError, ValueError):
        return 10_000


console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))

#: width of a table printed to a pipe or file: a log or an 80-column terminal reads it as is
TABLE_WIDTH = 80


def _natural_width(table: Table) -> int:
    buffer = io.StringIO()
    Console(file=buffer, width=100_000).print(table)
    return max((len(line) for line in buffer.getvalue().splitlines()), default=0)


def _vertical(table: Table) -> Table:
    """``table`` turned on its side: one block of ``column  value`` lines per row (as
    ``psql``'s expanded display), the rows separated by a rule."""
    out = Table(title=table.title, show_header=False, box=box.SIMPLE, show_lines=True,
                pad_edge=False)
    out.add_column(style="bold", no_wrap=True)
    out.add_column(overflow="fold")
    rows = [list(c.cells) for c in table.columns]
    for r in range(table.row_count):
        block = [(str(c.header), rows[i][r]) for i, c in enumerate(table.columns)]
        names = Text("\n".join(name for name, _ in block))
        values = Text("\n").join(v if isinstance(v, Text) else Text.from_markup(str(v))
                                  for _, v in block)
        out.add_row(names, values)
    return out


def print_table(table: Table, stream: Console | None = None) -> None:
    """Print ``table`` within the terminal's width, or ``TABLE_WIDTH`` columns when piped.

    A wider table of three or more columns is printed on its side (one block of
    ``column  value`` lines per row) rather than squeezed, and a name/value table folds its
    long values onto further lines: a number in a table is read whole, never cut."""
    stream = stream or console
    width = stream.width if stream.is_terminal else min(stream.width, TABLE_WIDTH)
    shown = table
    if _natural_width(table) > width:
        if len(table.columns) > 2:
            shown = _vertical(table)
        else:  # a name/value table is already on its side: fold the long values
            for column in table.columns:
                column.overflow = "fold"
    stream.print(shown, width=width)


#: seconds between two progress lines of one stage when stderr is not a terminal
LINE_EVERY = 10.0


class Reporter:
    """Progress of one long command (train, attack, audit, analyze).

    ``update(description=..., completed=..., advance=..., total=...)`` as rich's
    ``Progress.update``; ``line(text)`` prints a line of its own (train's per-round result)
    when stderr is not a terminal. A changed description is a new stage: its line is printed
    at once. A stage that lasts gets a line every ``every`` seconds from a heartbeat thread,
    so a log shows the command is alive. ``announce``: print the first stage's line on
    entry (off where the command still validates its input in that stage, so that a usage
    error stays the only line).
    """

    def __init__(self, description: str, total: float | None = None, *, quiet: bool = False,
                 transient: bool = True, every: float = LINE_EVERY, announce: bool = True,
                 stream: Console | None = None) -> None:
        self.console = stream or err_console
        self.quiet, self.every, self.announce = quiet, every, announce
        self.live = self.console.is_terminal and not quiet
        self.description, self.total, self.completed = description, total, 0.0
        self.info = ""
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                             TimeElapsedColumn(), console=self.console, transient=transient,
                             disable=not self.live)
        self._task = self._bar.add_task(description, total=total, info="")

    def __enter__(self) -> Reporter:
        self._bar.__enter__()
        if not self.live and not self.quiet:
            if self.announce:
                self._emit()
            self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                          name="privfedcal-progress")
            self._beat.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        self._bar.__exit__(*exc)

    def update(self, *, description: str | None = None, completed: float | None = None,
               advance: float = 0, total: float | None = None, info: str | None = None) -> None:
        new_stage = description is not None and description != self.description
        if description is not None:
            self.description = description
        if total is not None:
            self.total = total
        if completed is not None:
            self.completed = completed
        self.completed += advance
        fields: dict[str, Any] = {} if info is None else {"info": info}
        if info is not None:
            self.info = info
        self._bar.update(self._task, description=self.description, completed=self.completed,
                         total=self.total, **fields)
        if new_stage:
            self._emit()

    def line(self, text: str) -> None:
        """A line of its own on stderr when not on a terminal (and not quiet)."""
        if not self.live and not self.quiet:
            with self._lock:
                self.console.print(text, highlight=False, markup=False, soft_wrap=True)
                self._last = time.monotonic()

    def _emit(self) -> None:
        if self.live or self.quiet:
            return
        count = "" if not self.total else f" [{self.completed:.10g}/{self.total:.10g}]"
        info = f" ({self.info})" if self.info else ""
        self.line(f"privfedcal: {self.description}{count}{info}, "
                  f"{time.monotonic() - self._start:.0f} s")

    def _heartbeat(self) -> None:
        """A line whenever ``every`` seconds passed without one."""
        while not self._stop.wait(min(self.every, 1.0)):
            if time.monotonic() - self._last >= self.every:
                self._emit()
