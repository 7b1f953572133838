"""Progress of an attack in the engine's unit of work, and what an interrupted one keeps.

``runner.execute`` counts restart-steps (one Adam step of one restart of one target,
``engine.py``) through a ``Tracker`` it installs as the engine's ``WorkSink``: the total is
the planned steps x restarts of every inversion, reduced as targets stop early, so the
count keeps moving inside a long batch and gives an ETA (``Progress.eta``). The CLI
(``attack invert``) and the Python API receive the same ``Progress`` through
``execute(on_progress=...)``. An interrupted ``execute`` raises ``Stopped`` with the
targets it finished; ``resume.py`` writes them to a partial attack.json.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from privfedcal.attacks.reconstruction.scoring import Attacked


@dataclass(frozen=True)
class Progress:
    """Where ``execute`` stands. ``steps``: restart-steps run (one Adam step of one restart of
    one target, the engine's unit of work, engine.py) of ``total``: the planned steps x
    restarts of every inversion, reduced as targets stop early (and grown when a job whose
    work was not planned starts one). ``images``/``images_total``: the same counted in
    image-steps (a step of a target of n images counts n), what the ETA is measured in, as a
    step's cost grows with its images. ``targets`` of ``of`` jobs are done; ``running``
    names what runs now; ``elapsed``: seconds since ``execute`` started."""

    steps: int
    total: int
    targets: int
    of: int
    elapsed: float
    running: str = ""
    images: int = 0
    images_total: int = 0
    #: the share of their step cap (image-steps) the targets that stopped so far ran
    stop_share: float | None = None

    @property
    def eta(self) -> float | None:
        """Seconds left at the average rate so far (image-steps per second); None before
        the first step. The work left to the caps is scaled by ``stop_share`` once targets
        have stopped (a plateau often ends them far below the cap); before, it is the
        time to the caps, an upper estimate."""
        done, total = (self.images, self.images_total) if self.images else (self.steps,
                                                                            self.total)
        if done <= 0 or self.elapsed <= 0:
            return None
        share = 1.0 if self.stop_share is None else self.stop_share
        return max(total - done, 0) * share * self.elapsed / done


class Tracker:
    """The engine's ``WorkSink`` for one ``execute``: counts restart-steps, image-steps and
    targets, and passes a ``Progress`` to ``on_progress`` at most every ``every`` seconds
    while steps run, and at every new unit and finished target."""

    def __init__(self, of: int, targets: int, on_progress: Callable[[Progress], None] | None,
                 every: float = 0.2) -> None:
        self.done, self.total, self.reserved = [0, 0], [0, 0], [0, 0]  # [steps, images]
        self.stops = [0, 0]  # image-steps run and planned by the targets that stopped
        self.targets, self.of, self.running = targets, of, ""
        self.on_progress, self.every = on_progress, every
        self.start = self.last = time.monotonic()

    def plan(self, steps: int, images: int) -> None:
        """The work ``execute`` plans before it starts."""
        self.total = [steps, images]

    def unit(self, running: str, steps: int = 0, images: int = 0) -> None:
        """A job or batch starts; its planned work (already in the total) is ``steps``
        (``images``): the engine's ``planned`` of it does not count twice."""
        self.total = [t - r for t, r in zip(self.total, self.reserved, strict=True)]
        self.running, self.reserved = running, [steps, images]
        self.emit()

    def planned(self, steps: int, images: int) -> None:
        for k, n in enumerate((steps, images)):
            covered = min(n, self.reserved[k])
            self.reserved[k] -= covered
            self.total[k] += n - covered

    def advance(self, steps: int, images: int) -> None:
        self.done[0] += steps
        self.done[1] += images
        if time.monotonic() - self.last >= self.every:
            self.emit()

    def saved(self, steps: int, images: int) -> None:
        self.total[0] -= steps
        self.total[1] -= images

    def stopped(self, run: int, planned: int) -> None:
        self.stops[0] += run
        self.stops[1] += planned

    def target_done(self) -> None:
        self.targets += 1
        self.emit()

    def emit(self) -> None:
        self.last = now = time.monotonic()
        if self.on_progress is not None:
            (steps, images), (total, images_total) = self.done, self.total
            self.on_progress(Progress(steps, max(total, steps), self.targets, self.of,
                                      now - self.start, self.running, images,
                                      max(images_total, images),
                                      self.stops[0] / self.stops[1] if self.stops[1] else None))


class Stopped(KeyboardInterrupt):
    """``execute`` interrupted (Ctrl-C, or SIGTERM under ``sigterm_interrupts``):
    ``finished`` maps plan indices to the targets done (those given as ``done`` included)."""

    def __init__(self, finished: dict[int, Attacked], of: int) -> None:
        super().__init__(f"{len(finished)} of {of} targets done")
        self.finished, self.of = finished, of


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """In this block SIGTERM (a batch scheduler's stop) raises KeyboardInterrupt as SIGINT
    does, so ``execute`` keeps its finished targets either way. Main thread only (where
    Python handles signals); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
