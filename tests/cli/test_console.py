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


def _printed(table) -> str:
    import io

    from rich.console import Console

    from privfedcal.cli.console import print_table

    stream = Console(file=io.StringIO(), width=10_000)  # what cli/console makes of a pipe
    assert not stream.is_terminal
    print_table(table, stream)
    return stream.file.getvalue()


def test_a_wide_table_is_printed_on_its_side_within_80_columns_when_piped():
    """13 columns of long numbers (the audit's table) in a pipe: every line within 80
    columns, no cell cut or folded, each row a block of ``column  value`` lines."""
    from rich.table import Table

    from privfedcal.cli.console import TABLE_WIDTH

    table = Table(title="wide")
    names = [f"column-{i}" for i in range(13)]
    for name in names:
        table.add_column(name)
    rows = [[f"{1234567.891 * (i + 1) * (r + 1):.4f}" for i in range(13)] for r in range(2)]
    for row in rows:
        table.add_row(*row)
    text = _printed(table)
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= TABLE_WIDTH and "…" not in text
    pairs = [x.split() for x in lines if x.strip().startswith("column-")]
    assert pairs == [[n, v] for row in rows for n, v in zip(names, row, strict=True)]


def test_a_table_that_fits_is_printed_as_it_is():
    from rich.table import Table

    table = Table(title="narrow")
    table.add_column("metric")
    table.add_column("value")
    table.add_row("accuracy", "0.9321")
    table.add_row("epsilon", "8.0")
    lines = _printed(table).splitlines()
    assert any("metric" in x and "value" in x for x in lines)  # the header row, on one line
    assert any("accuracy" in x and "0.9321" in x for x in lines)


def test_a_wide_name_value_table_folds_its_values():
    from rich.table import Table

    from privfedcal.cli.console import TABLE_WIDTH

    table = Table(title="privfedcal run")
    table.add_column("metric")
    table.add_column("value")
    long = "balsoftmax (local balsoftmax, calibration none) " * 3
    table.add_row("method", long)
    table.add_row("accuracy", "0.8625")
    lines = _printed(table).splitlines()
    assert max(len(x) for x in lines) <= TABLE_WIDTH
    assert any("accuracy" in x and "0.8625" in x for x in lines)  # rows stay rows
    assert "".join(lines).count("balsoftmax") == 6
