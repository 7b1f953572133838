"""Progress of an attack (attacks/reconstruction/progress.py): the ETA from hand-computed rates, the
tracker's total (a unit's planned work counted once, early stops and unplanned work), and
SIGTERM turned into the KeyboardInterrupt that keeps finished targets."""

from __future__ import annotations

import os
import signal

import pytest

from privfedcal.attacks.reconstruction.progress import (
    Progress,
    Stopped,
    Tracker,
    sigterm_interrupts,
)


def test_eta_is_the_remaining_work_at_the_rate_so_far():
    # image-steps: 300 of 1200 in 6 s -> 50/s, 900 left -> 18 s
    p = Progress(steps=100, total=400, targets=1, of=4, elapsed=6.0, images=300,
                 images_total=1200)
    assert p.eta == pytest.approx(18.0)
    # without image counts: restart-steps, 100 of 400 in 6 s -> 18 s as well
    assert Progress(100, 400, 1, 4, 6.0).eta == pytest.approx(18.0)
    assert Progress(0, 400, 0, 4, 6.0).eta is None  # no rate before the first step
    assert Progress(400, 400, 4, 4, 6.0, images=9, images_total=9).eta == 0
    # targets that stopped ran a quarter of their caps: the 900 left to the caps -> 225
    p = Progress(100, 400, 1, 4, 6.0, images=300, images_total=1200, stop_share=0.25)
    assert p.eta == pytest.approx(4.5)


def test_tracker_counts_each_planned_step_once():
    seen = []
    t = Tracker(of=3, targets=1, on_progress=seen.append, every=0.0)
    t.plan(1100, 5100)  # a batch of 1000 (5000 image-steps), one of 100 (100)
    t.unit("batch", 1000, 5000)
    t.planned(600, 3000)  # the engine announces the batch's work in two optimisations
    t.planned(400, 2000)
    assert t.total == [1100, 5100]
    t.advance(200, 1000)
    t.saved(300, 1500)  # a target stopped early
    t.stopped(1000, 4000)
    t.target_done()
    assert seen[-1].stop_share == 0.25
    t.unit("lone job")  # unplanned: its optimisation grows the total
    t.planned(50, 50)
    t.advance(50, 50)
    last = seen[-1]
    assert (last.steps, last.total, last.images, last.images_total) == (250, 850, 1050, 3650)
    assert (last.targets, last.of, last.running) == (2, 3, "lone job")
    t.unit("second batch", 100, 100)  # interrupted before its optimisation started ...
    t.unit("")  # ... gives its planned work back
    assert t.total == [750, 3550]


def test_sigterm_raises_keyboard_interrupt_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**6):  # the handler runs between bytecodes
            pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_stopped_is_a_keyboard_interrupt_with_the_finished_targets():
    stop = Stopped({0: "done"}, 3)  # type: ignore[dict-item]
    assert isinstance(stop, KeyboardInterrupt) and stop.finished == {0: "done"}
    assert "1 of 3" in str(stop)
