"""cli/console.py's Reporter when stderr is not a terminal (as under pytest's capture): a
line per stage, a heartbeat line while a stage lasts, nothing with quiet."""

from __future__ import annotations

import time

from privfedcal.cli.console import Reporter


def _lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def test_a_line_per_stage_and_none_when_quiet(capsys):
    with Reporter("job", total=3, every=1e9) as r:
        r.update(description="job: first", advance=1)
        r.update(description="job: first", advance=1)  # same stage: no line
        r.update(description="job: second", advance=1)
        r.line("round 1/3: accuracy 0.5")
    lines = _lines(capsys.readouterr().err)
    assert [x.split(",")[0] for x in lines] == [
        "privfedcal: job [0/3]", "privfedcal: job: first [1/3]",
        "privfedcal: job: second [3/3]", "round 1/3: accuracy 0.5"]
    with Reporter("job", total=3, quiet=True) as r:
        r.update(description="job: first", advance=1)
        r.line("round 1/3: accuracy 0.5")
    assert capsys.readouterr().err == ""


def test_a_long_stage_gets_heartbeat_lines(capsys):
    """A stage with no update (an audit setting training for minutes) still prints."""
    got: list[str] = []
    with Reporter("audit x: training", every=0.05, announce=False):
        end = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < end:  # wait for two beats, not a time
            time.sleep(0.05)
            got += _lines(capsys.readouterr().err)
    assert len(got) >= 2 and all(x.startswith("privfedcal: audit x: training, ") for x in got)


def test_announce_off_keeps_quiet_until_a_stage_starts(capsys):
    with Reporter("loading", every=1e9, announce=False) as r:
        assert capsys.readouterr().err == ""
        r.update(description="working")
    assert [x.split(",")[0] for x in _lines(capsys.readouterr().err)] == ["privfedcal: working"]
