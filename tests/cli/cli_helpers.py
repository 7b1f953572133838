"""Shared helpers of the CLI tests: run the app in-process, check one-line usage errors."""

from __future__ import annotations

import pytest

from privfedcal.cli.main import main


def run_cli(args, capsys):
    """Run ``privfedcal ARGS`` expecting it to exit; returns (exit code, captured output)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr()


def assert_usage_error(args, capsys, *needles):
    """Exit code 2, exactly one line on stderr, no traceback, every needle in that line."""
    code, out = run_cli(args, capsys)
    assert code == 2, out
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert len(lines) == 1, out.err
    assert "Traceback" not in out.err
    for n in needles:
        assert n in lines[0], lines[0]
