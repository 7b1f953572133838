"""``privfedcal audit``: csv + png for a 2-setting grid, refused settings kept as noted rows,
the csv cell format, and bad flags as one line with exit 2."""

from __future__ import annotations

import csv
import math

import pytest

from privfedcal.attacks.audit import COLUMNS, AuditConfig, Setting, write_csv
from privfedcal.cli.audit import parse_eps, parse_secagg
from privfedcal.cli.main import main
from privfedcal.errors import UsageError

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--rounds", "1", "--steps", "5", "--restarts", "1", "--clients", "3",
         "--device", "cpu"]


def read_rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_two_setting_grid(tmp_path, capsys):
    out = tmp_path / "audit"
    main(["audit", "--eps", "inf,4", "--secagg", "off", "--methods", "ccvr", *SMALL,
          "--out", str(out)])
    rows = read_rows(out / "audit.csv")
    assert list(rows[0]) == list(COLUMNS)
    assert [(r["method"], r["eps"], r["secagg"]) for r in rows] == \
        [("ccvr", "inf", "off"), ("ccvr", "4", "off")]
    base, dp = rows
    assert base["epsilon_spent"] == "inf" and 0 < float(dp["epsilon_spent"]) <= 4
    assert float(base["class_inference_accuracy"]) == 1.0  # plaintext counts
    for r in rows:
        assert 0 <= float(r["accuracy"]) <= 1 and int(r["targets"]) >= 1
        assert math.isfinite(float(r["psnr"])) and -1 <= float(r["feature_cosine"]) <= 1
    assert (out / "audit.png").read_bytes()[:8] == PNG
    assert (out / "runs" / "ccvr-eps4-secagg-off" / "attack.json").is_file()
    assert "privfedcal audit" in capsys.readouterr().out


def test_refused_settings_are_rows_with_notes(tmp_path, capsys):
    out = tmp_path / "audit"
    # epsilon 1e-9 cannot be met by any noise the planner allows; fedavg uploads nothing
    main(["audit", "--eps", "1e-9", "--secagg", "off", "--methods", "ccvr,fedavg", *SMALL,
          "--out", str(out)])
    rows = read_rows(out / "audit.csv")
    assert [r["method"] for r in rows] == ["ccvr", "fedavg"]
    assert all(r["note"].startswith("skipped") and r["accuracy"] == "" for r in rows)
    assert "nothing to attack" in rows[1]["note"]
    assert (out / "audit.png").read_bytes()[:8] == PNG
    assert "skipped" in capsys.readouterr().out


def test_csv_cells(tmp_path):
    path = write_csv([{"method": "ccvr", "eps": math.inf, "secagg": True, "psnr": math.nan,
                       "accuracy": 0.5, "note": ""}], tmp_path / "a.csv")
    (row,) = read_rows(path)
    assert (row["eps"], row["secagg"], row["psnr"], row["accuracy"]) == ("inf", "on", "", "0.5")


def test_grid_and_parsers():
    cfg = AuditConfig(eps=(1.0, math.inf), secagg=(False, True), methods=("ccvr", "creff"))
    assert len(cfg.settings()) == 8
    assert Setting("ccvr", math.inf, False).unprotected
    assert Setting("creff", 2.0, True).name == "creff-eps2-secagg-on"
    assert parse_eps("1, 2,inf,2") == (1.0, 2.0, math.inf)
    assert parse_secagg("off,on,true") == (False, True)
    with pytest.raises(UsageError):
        parse_eps("0")
    with pytest.raises(UsageError):
        AuditConfig(attack_clients=0)


def test_bad_flags_are_one_line(capsys):
    for args, needle in ((["--eps", "abc"], "--eps"), (["--secagg", "maybe"], "--secagg"),
                         (["--methods", "nope"], "unknown method")):
        with pytest.raises(SystemExit) as exc:
            main(["audit", *args])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], err
