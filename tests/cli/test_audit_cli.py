"""``privfedcal audit``: csv + png for a 2-setting grid, refused settings kept as noted rows,
the csv cell format, and bad flags as one line with exit 2."""

from __future__ import annotations

import csv
import json
import math

import pytest

from privfedcal.attacks.reconstruction.leakage_sweep import COLUMNS, AuditConfig, Setting, write_csv
from privfedcal.cli.audit_command import parse_eps, parse_secagg
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
    assert float(base["class_inference_accuracy"]) == 1.0  # plaintext counts
    # every row is its run's summary and attack records, as written in the run folder
    for r in rows:
        run = out / "runs" / f"ccvr-eps{r['eps']}-secagg-off"
        s = json.loads((run / "summary.json").read_text())
        assert float(r["accuracy"]) == pytest.approx(s["accuracy"], rel=1e-5)
        records = [x for x in json.loads((run / "attack.json").read_text()) if "psnr" in x]
        assert int(r["targets"]) == len(records) >= 1
        for key in ("psnr", "feature_cosine"):
            vals = [x[key] for x in records if x[key] is not None]
            assert float(r[key]) == pytest.approx(sum(vals) / len(vals), rel=1e-5)
    assert base["epsilon_spent"] == "inf"
    spent = json.loads((out / "runs" / "ccvr-eps4-secagg-off" / "summary.json").read_text())[
        "privacy"]["epsilon_spent"]
    assert float(dp["epsilon_spent"]) == pytest.approx(spent, rel=1e-5)
    assert 0.99 * 4 <= spent <= 4  # the planned noise spends the budget tightly
    assert (out / "audit.png").read_bytes()[:8] == PNG
    assert "privfedcal audit" in capsys.readouterr().out


def test_refused_settings_are_rows_with_notes(tmp_path, capsys):
    out = tmp_path / "audit"
    # epsilon 1e-9 cannot be met by any noise the planner allows
    main(["audit", "--eps", "1e-9", "--secagg", "off", "--methods", "ccvr", *SMALL,
          "--out", str(out)])
    rows = read_rows(out / "audit.csv")
    assert [r["method"] for r in rows] == ["ccvr"]
    assert all(r["note"].startswith("skipped") and r["accuracy"] == "" for r in rows)
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
                         (["--methods", "nope"], "unknown method"),
                         # no calibration upload: refused before any of its runs
                         (["--methods", "ccvr,fedavg"], "fedavg"),
                         (["--methods", "moon"], "methods that upload one: ccvr, creff"),
                         (["--steps", "0"], "--steps >= 1"),
                         (["--restarts", "0"], "--restarts >= 1"),
                         (["--rounds", "-1"], "--rounds >= 1"),
                         (["--attack-batch", "0"], "--attack-batch must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            main(["audit", *args])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], err


def test_inversion_flags_are_the_attacks_options_with_the_audits_defaults(capsys, monkeypatch):
    """``--steps``, ``--restarts`` and ``--attack-batch`` are ``InversionOptions``' fields
    (their help), with the defaults ``AUDIT_DEFAULTS`` overrides (2 restarts, the attacks'
    4) shown in the help and used when not given; a changed override table changes both."""
    import dataclasses

    from privfedcal.attacks.attack_options import option_flags
    from privfedcal.attacks.reconstruction import inversion_options as leakage_sweep
    from privfedcal.attacks.reconstruction.inversion_options import InversionOptions
    from privfedcal.cli.audit_command import audit_command

    attack = {f.name: f for f in option_flags(InversionOptions)}
    assert leakage_sweep.AUDIT_DEFAULTS == {"restarts": 2} and attack["restarts"].default == 4
    config = AuditConfig()
    assert (config.steps, config.restarts, config.attack_batch) == (
        attack["steps"].default, 2, attack["attack_batch"].default)
    try:  # --help exits 0: main returns (or exits with 0)
        main(["audit", "--help"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for name in ("steps", "attack_batch"):
        assert f"{attack[name].help} (default {attack[name].default})" in shown
    assert f"{attack['restarts'].help} (default 2)" in shown
    # the flags are read from the table when the command is built
    monkeypatch.setattr(leakage_sweep, "AUDIT_DEFAULTS", {"restarts": 3, "steps": 7})
    params = audit_command().__signature__.parameters
    helps = {n: params[n].annotation.__metadata__[0].help for n in ("steps", "restarts")}
    assert helps == {"steps": f"{attack['steps'].help} (default 7)",
                     "restarts": f"{attack['restarts'].help} (default 3)"}
    assert params["restarts"].default is None  # not given: AuditConfig's default
    assert {f.name for f in dataclasses.fields(InversionOptions)} >= set(
        leakage_sweep.AUDIT_INVERSION_OPTIONS)


def test_an_earlier_audit_is_kept_without_overwrite(tmp_path, capsys):
    out = tmp_path / "audit"
    out.mkdir()
    (out / "audit.csv").write_text("earlier\n")
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--eps", "1e-9", "--secagg", "off", "--methods", "ccvr", *SMALL,
              "--out", str(out)])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "--overwrite" in lines[0]
    assert (out / "audit.csv").read_text() == "earlier\n" and not (out / "runs").exists()
    main(["audit", "--eps", "1e-9", "--secagg", "off", "--methods", "ccvr", *SMALL,
          "--out", str(out), "--overwrite", "--quiet"])
    assert read_rows(out / "audit.csv")[0]["method"] == "ccvr"
    err = capsys.readouterr().err
    assert "privfedcal: audit" not in err  # --quiet: no progress lines


def test_progress_lines_when_not_on_a_terminal(tmp_path, capsys):
    main(["audit", "--eps", "1e-9", "--secagg", "off", "--methods", "ccvr", *SMALL,
          "--out", str(tmp_path / "audit")])
    err = capsys.readouterr().err
    assert "privfedcal: audit [0/1]" in err  # start
    assert "privfedcal: audit ccvr-eps1e-09-secagg-off: training" in err  # a stage


def test_the_audit_reports_what_the_secure_sums_of_a_run_determine(tmp_path):
    """The whole-run attacks (disaggregation across rounds) fill their columns: under
    --secagg with half the clients per round, rounds select whole cohorts of at least
    --secagg-min-clients (2), so no client's own value is determined and the finest group
    the sums resolve is a cohort (CReFF's client weighting: holder indicators)."""
    out = tmp_path / "audit"
    main(["audit", "--eps", "inf", "--secagg", "on", "--methods", "creff",
          "--rounds", "4", "--steps", "2", "--restarts", "1", "--clients", "4",
          "--participation", "0.5", "--device", "cpu", "--out", str(out)])
    (secure,) = read_rows(out / "audit.csv")
    assert secure["disaggregated"] == "0/4" and secure["finest_group"] == "2"
    records = json.loads((out / "runs" / "creff-epsinf-secagg-on" / "attack.json").read_text())
    assert {r["key"] for r in records if r.get("target") == "disaggregate"} == {"grad", "holders"}
    with pytest.raises(UsageError, match="--participation"):
        AuditConfig(participation=0.0)
