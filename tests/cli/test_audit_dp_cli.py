"""``privfedcal audit dp``: one csv row per audited channel (and one for the one-run audit of
the whole run's uploads) and a plot, from train's options or from a run folder's config; bad input as one line with exit 2; the bare ``audit`` group
keeps its reconstruction sweep's options."""

from __future__ import annotations

import csv

from cli_helpers import assert_usage_error

from privfedcal.attacks.distinguishing.games import COLUMNS
from privfedcal.cli.main import main
from privfedcal.federation.runfolder import write_config
from privfedcal.settings.run_config import RunConfig

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--dataset", "digits", "--clients", "3", "--rounds", "1", "--device", "cpu"]


def rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_audit_dp_from_train_options(tmp_path, capsys):
    out = tmp_path / "a"
    main(["audit", "dp", "--method", "ccvr", "--dp-eps", "1", *SMALL, "--trials", "20000",
          "--out", str(out)])
    row, whole = rows(out / "dp_audit.csv")
    assert list(row) == list(COLUMNS)
    assert row["channel"] == "ccvr-stats" and row["trials"] == "40000"
    # the whole run's uploads in one run: 3 clients x 10 classes x 128 axes of canaries
    assert whole["channel"] == "ccvr-stats (one run)" and whole["trials"] == "1"
    assert whole["canary"].startswith("3840 canaries") and whole["claimed_eps"] == row["claimed_eps"]
    assert 0.99 < float(row["claimed_eps"]) <= 1.0 and 0 <= float(row["eps_lower"]) < 1.0
    assert (out / "dp_audit.png").read_bytes()[:8] == PNG
    text = capsys.readouterr().out
    assert "consistent with the claim" in text and "ccvr-stats" in text


def test_audit_dp_of_a_run_folder_writes_into_it(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_config(run, RunConfig.of(method="creff", dp_eps=2.0, dataset="digits", clients=3,
                                rounds=1, device="cpu").to_dict())
    main(["audit", "dp", "--run", str(run), "--trials", "2000", "--no-one-run"])
    (row,) = rows(run / "dp_audit.csv")
    assert row["channel"] == "creff-grad" and float(row["claimed_eps"]) <= 2.0
    capsys.readouterr()  # the audit's progress lines
    assert_usage_error(["audit", "dp", "--run", str(run), "--dp-eps", "3"], capsys,
                       "--run", "--dp-eps")


def test_every_channel_stops_at_its_budget_with_its_rows_and_progress(tmp_path, capsys):
    """DP-SGD with a budget no channel can keep: the game stops at the fewest trials, the
    one-run training after its first round; both rows are written and marked, and the
    progress lines (stderr is not a terminal here) name each stage and each row."""
    out = tmp_path / "b"
    main(["audit", "dp", "--method", "fedavg", "--dp-train", "--dp-eps", "4", *SMALL,
          "--rounds", "2", "--threads", "1", "--budget-s", "1e-6", "--out", str(out)])
    game, whole = rows(out / "dp_audit.csv")
    assert (game["channel"], game["trials"], game["stopped"]) == ("dp-sgd", "4", "budget")
    assert (whole["channel"], whole["stopped"]) == ("dp-sgd (one run)", "budget")
    assert "1 of the run's 2 rounds" in whole["canary"]
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert any("audit dp: dp-sgd, trials per side" in line for line in lines)
    assert any("audit dp: dp-sgd (one run), training rounds" in line for line in lines)
    assert any(line.startswith("dp-sgd: 4 trials") and "stopped by its time budget" in line
               for line in lines)
    assert "stopped by its time budget" in captured.out  # the table's verdicts
    main(["audit", "dp", "--method", "fedavg", "--dp-train", "--dp-eps", "4", *SMALL,
          "--budget-s", "1e-6", "--no-one-run", "--quiet", "--out", str(tmp_path / "q")])
    assert "audit dp:" not in capsys.readouterr().err


def test_bad_input_is_one_line(tmp_path, capsys):
    assert_usage_error(["audit", "dp", "--method", "ccvr", *SMALL, "--channels", "x"], capsys,
                       "--channels")
    assert_usage_error(["audit", "dp", "--method", "ccvr", *SMALL, "--budget-s", "0"], capsys,
                       "--budget-s")
    assert_usage_error(["audit", "dp", "--method", "fedavg", *SMALL], capsys, "no channel")
    assert_usage_error(["audit", "dp", "--run", str(tmp_path / "none")], capsys, "no such")
    assert_usage_error(["audit", "dp", "--method", "ccvr", *SMALL, "--trials", "3"], capsys,
                       "--trials")
    assert_usage_error(["audit", "--eps", "nope"], capsys, "--eps")   # the bare group
