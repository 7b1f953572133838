"""What the API's long calls show while they run: log records through the ``privfedcal``
logger and a progress bar in terminals and notebooks.

The logger follows library practice: it carries a ``NullHandler`` and prints nothing unless
the application configures logging (``logging.basicConfig(level=logging.INFO)`` shows one
line as a run starts, one per evaluated round and one as it ends, with its time and
accuracy). The bar is the visible part, on by default when the session is interactive:
stderr is a terminal (rich's bar, as the CLI's) or the call runs in a Jupyter kernel (one text
line redrawn in place through IPython's display, which needs no widget library).
``progress=False`` turns it off; ``progress=callable`` replaces it with the caller's function.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from privfedcal.attacks.reconstruction.progress import Progress

logger = logging.getLogger("privfedcal")
logger.addHandler(logging.NullHandler())

#: seconds between two redraws of a notebook's bar (each is a message to the front end)
NOTEBOOK_EVERY = 0.25


def in_notebook() -> bool:
    """True inside a Jupyter kernel (a notebook, JupyterLab, VS Code, Colab): IPython is
    running and its shell talks to a kernel, not to a terminal."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)()
    return getattr(shell, "kernel", None) is not None


def interactive() -> bool:
    """A person is probably watching: stderr is a terminal, or this is a notebook."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        tty = False
    return tty or in_notebook()


def seconds(s: float | None) -> str:
    """``s`` for a person: ``4.2 s``, ``42 s``, ``3 min 5 s``, ``2 h 10 min``."""
    if s is None:
        return "?"
    if s < 9.95:
        return f"{s:.1f} s"
    s = round(s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Bar(Protocol):
    def update(self, completed: float, total: float, info: str) -> None: ...
    def close(self) -> None: ...


class TerminalBar:
    """rich's bar on stderr, kept on screen when done (as ``privfedcal train``'s)."""

    def __init__(self, description: str, total: float, completed: float = 0) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                             TimeElapsedColumn(), console=Console(stderr=True))
        self._task = self._bar.add_task(description, total=total, completed=int(completed),
                                        info="")
        self._bar.start()

    def update(self, completed: float, total: float, info: str) -> None:
        self._bar.update(self._task, completed=completed, total=total, info=info)

    def close(self) -> None:
        self._bar.stop()


class NotebookBar:
    """One line of text redrawn in place in a notebook's output (an IPython display with
    an id), at most every ``NOTEBOOK_EVERY`` seconds and once more when closed."""

    WIDTH = 24

    def __init__(self, description: str, total: float, completed: float = 0) -> None:
        # IPython is the notebook's, not a dependency: this runs only inside its kernel
        # (``in_notebook``), where it is already imported
        display = importlib.import_module("IPython.display").display
        self.description, self.state = description, (completed, total, "")
        self.start = self.last = time.monotonic()
        self.handle = display(self._data(), raw=True, display_id=True)

    def _data(self) -> dict[str, str]:
        return {"text/plain": self.line()}

    def line(self) -> str:
        completed, total, info = self.state
        share = min(max(completed / total, 0.0), 1.0) if total else 0.0
        filled = round(share * self.WIDTH)
        bar = "█" * filled + "░" * (self.WIDTH - filled)
        return (f"{self.description} {bar} {completed:.10g}/{total:.10g}"
                f"{'  ' + info if info else ''}  {seconds(time.monotonic() - self.start)}")

    def update(self, completed: float, total: float, info: str) -> None:
        self.state = (completed, total, info)
        if time.monotonic() - self.last >= NOTEBOOK_EVERY:
            self.last = time.monotonic()
            self.handle.update(self._data(), raw=True)

    def close(self) -> None:
        self.handle.update(self._data(), raw=True)


def open_bar(progress: object, description: str, total: float,
             completed: float = 0) -> Bar | None:
    """The bar ``progress`` asks for: None (the default) when interactive, True always,
    False or a callable never."""
    if progress is False or callable(progress) or (progress is None and not interactive()):
        return None
    cls = NotebookBar if in_notebook() else TerminalBar
    return cls(description, total, completed)


# ---- training ---------------------------------------------------------------------------------

def round_line(rec: dict[str, Any], total: int) -> str:
    """The log line of an evaluated round."""
    train = "withheld (DP)" if rec["train_loss"] is None else f"{rec['train_loss']:.4f}"
    return (f"round {rec['round']}/{total}: accuracy {rec['accuracy']:.4f}, test loss "
            f"{rec['loss']:.4f}, train loss {train}, {rec['seconds']:.1f} s")


def run_simulator(sim: Any, progress: bool | Callable[[dict[str, Any]], None] | None,
                  where: str) -> dict[str, Any]:
    """Run ``sim`` (a ``Simulator``) to its end with its log lines and bar, close its log
    and return its summary. ``where`` says where the run is kept, for the first line."""
    loop = sim.loop
    name = f"{loop.method} on {loop.data.dataset}"
    first = sim.start_round
    last = loop.training.rounds
    rounds = f"{last} rounds" if first == 1 else f"rounds {first}-{last}"
    logger.info("%s: %s, %d clients -> %s", name, rounds, loop.data.clients, where)
    bar = open_bar(progress, name, loop.training.rounds, first - 1)
    start = time.monotonic()

    def on_round(rec: dict[str, Any]) -> None:
        if "accuracy" in rec:
            logger.info("%s: %s", name, round_line(rec, loop.training.rounds))
        if callable(progress):
            progress(rec)
        if bar is not None:
            done = rec["round"] - first + 1
            left = (time.monotonic() - start) / done * (loop.training.rounds - rec["round"])
            info = [f"acc {rec['accuracy']:.4f}"] if "accuracy" in rec else []
            info += [f"ETA {seconds(left)}"] if rec["round"] < loop.training.rounds else []
            bar.update(rec["round"], loop.training.rounds, ", ".join(info))

    try:
        summary: dict[str, Any] = sim.run(progress=on_round)
    finally:
        if bar is not None:
            bar.close()
    sim.log.close()
    before = summary.get("accuracy_before_calibration")
    logger.info("%s: done in %s, accuracy %.4f%s", name, seconds(time.monotonic() - start),
                summary["accuracy"],
                "" if before is None else f" ({before:.4f} before calibration)")
    return summary


# ---- attacks ----------------------------------------------------------------------------------

class AttackWatch:
    """What an attack shows: its start and end at INFO, each finished target at DEBUG, and
    the bar over optimisation steps (with the engine's ETA), or the caller's callable. The
    watch itself is the ``on_progress`` to give the attack engine (``runner.execute``)."""

    def __init__(self, progress: bool | Callable[[Progress], None] | None, name: str,
                 where: str) -> None:
        self.progress, self.bar_name, self.name = progress, name, f"{name} on {where}"
        self.bar: Bar | None = None
        self.opened, self.targets = False, 0
        self.start = time.monotonic()

    def __enter__(self) -> AttackWatch:
        logger.info("%s: started", self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, p: Progress) -> None:
        if callable(self.progress):
            self.progress(p)
        if p.targets > self.targets:
            self.targets = p.targets
            logger.debug("%s: %d of %d targets done, %s", self.name, p.targets, p.of,
                         seconds(p.elapsed))
        if not self.opened:  # the total is known once the engine has planned
            self.opened, self.bar = True, open_bar(self.progress, self.bar_name, p.total)
        if self.bar is not None:
            eta = "" if p.eta is None or p.steps >= p.total else f", ETA {seconds(p.eta)} or less"
            self.bar.update(p.steps, p.total, f"targets {p.targets}/{p.of}{eta}")

    def finished(self, records: int) -> None:
        logger.info("%s: %d records in %s", self.name, records,
                    seconds(time.monotonic() - self.start))
