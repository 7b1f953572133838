"""One spelling of the run folder (docs/usage.md, "Run folders on the command line"): a
positional argument or ``--run DIR``, the same in every command that reads a run."""

from __future__ import annotations

import csv

import pytest
from cli_helpers import assert_usage_error

from privfedcal.cli.main import main

FAST = ["--rounds", "1", "--clients", "3", "--local-epochs", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spelling")
    for name, seed in (("a", "0"), ("b", "1")):
        main(["train", *FAST, "--seed", seed, "--out", str(root / name)])
    return root


def test_report_takes_the_folder_either_way(runs, capsys):
    a = runs / "a"
    main(["report", "--run", str(a)])
    by_option = (a / "report.html").read_text()
    (a / "report.html").unlink()
    main(["report", str(a)])
    assert (a / "report.html").read_text() == by_option
    capsys.readouterr()


def test_compare_takes_positional_and_repeated_run(runs, tmp_path, capsys):
    a, b = runs / "a", runs / "b"
    main(["compare", str(a), "--run", str(b), "--out", str(tmp_path / "one")])
    main(["compare", "--run", str(a), "--run", str(b), "--out", str(tmp_path / "two")])
    one = list(csv.DictReader((tmp_path / "one" / "compare.csv").open()))
    two = list(csv.DictReader((tmp_path / "two" / "compare.csv").open()))
    assert len(one) == 2 and [r["run"] for r in one] == [r["run"] for r in two]
    capsys.readouterr()


@pytest.mark.parametrize("command", [["analyze"], ["report"], ["attack", "classes"],
                                     ["attack", "invert", "--stats"], ["audit", "dp"]])
def test_a_folder_given_twice_differently_is_refused(runs, capsys, command):
    assert_usage_error([*command, str(runs / "a"), "--run", str(runs / "b")], capsys,
                       "given twice", "give it once")


@pytest.mark.parametrize("command", [["analyze"], ["report"], ["compare"]])
def test_a_command_that_needs_a_run_says_how_to_give_it(command, capsys):
    assert_usage_error(command, capsys, "needs", "--run")
