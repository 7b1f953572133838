"""compare: rows from summaries, flags for runs that are not comparable, CSV round trip."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from privfedcal.report.comparison import collect, write_csv, write_html


def fake_run(path: Path, dataset="digits", eps=None, acc=0.5, method="fedavg",
             calibrator="none", before=None) -> Path:
    path.mkdir(parents=True)
    summary = {"method": method, "calibrator": calibrator, "dataset": dataset, "rounds": 3,
               "accuracy": acc, "per_class_accuracy": [acc, 0.25], "wall_seconds": 2.5,
               "uploaded_bytes": 100, "model_update_bytes": 924}
    if before is not None:
        summary["accuracy_before_calibration"] = before
    if eps is not None:
        summary["privacy"] = {"epsilon_target": eps, "epsilon_spent": eps - 0.01, "delta": 1e-5}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "config.json").write_text(json.dumps({"partition": "dirichlet", "alpha": 0.1,
                                                  "clients": 10}))
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"round": r, "accuracy": acc * r / 3}) + "\n" for r in (1, 2, 3)))
    return path


def test_comparable_runs_are_not_flagged(tmp_path):
    rows, warnings = collect([fake_run(tmp_path / "a"), fake_run(tmp_path / "b", acc=0.7)])
    assert warnings == [] and all(r["flags"] == "" for r in rows)
    assert rows[0]["bytes"] == 1024 and rows[0]["worst_class"] == 0.25
    assert rows[0]["partition"] == "dirichlet a=0.1 K=10"
    assert rows[1]["_curve"][-1] == (3, pytest.approx(0.7))


def test_different_dataset_and_budget_are_flagged(tmp_path):
    runs = [fake_run(tmp_path / "a"), fake_run(tmp_path / "b"),
            fake_run(tmp_path / "c", dataset="cifar10"), fake_run(tmp_path / "d", eps=4.0)]
    rows, warnings = collect(runs)
    assert len(warnings) == 2
    assert [r["flag"] for r in rows] == ["", "", "dataset", "eps"]
    # no majority: every run is flagged
    rows, _ = collect([fake_run(tmp_path / "e", eps=1.0), fake_run(tmp_path / "f", eps=8.0)])
    assert all(r["flag"] == "eps" for r in rows)


def test_csv_and_html(tmp_path):
    rows, warnings = collect([fake_run(tmp_path / "a"), fake_run(tmp_path / "b", eps=2.0)])
    with write_csv(rows, tmp_path / "c.csv").open() as f:
        got = list(csv.DictReader(f))
    # neither run has a calibrator: its accuracy is the one before calibration, none after
    assert [(g["accuracy_before"], g["accuracy_after"]) for g in got] == [("0.5", "")] * 2
    assert got[1]["epsilon"] == "1.99" and got[0]["epsilon"] == ""
    page = write_html(rows, warnings, tmp_path / "c.html").read_text()
    assert 'class="flagged"' in page and "differ in privacy budget" in page


def test_every_differing_setting_is_named_and_rounds_are_flagged(tmp_path):
    runs = [fake_run(tmp_path / n) for n in "abc"]
    for run, cfg in zip(runs, ({"lr": 0.01, "seed": 0}, {"lr": 0.05, "seed": 1},
                               {"lr": 0.01, "seed": 2, "method_params": {"mu": 0.1}}),
                        strict=True):
        base = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**base, **cfg, "threads": 7,
                                                     "out": str(run)}))
    summary = json.loads((runs[2] / "summary.json").read_text())
    (runs[2] / "summary.json").write_text(json.dumps({**summary, "rounds": 5}))
    rows, warnings = collect(runs)
    # unset in two runs of three: the third departs from the majority
    assert [r["differs"] for r in rows] == [
        "seed=0", "lr=0.05, seed=1", "method_params.mu=0.1, seed=2"]
    assert [r["flag"] for r in rows] == ["", "", "rounds"]
    assert any("rounds" in w for w in warnings)
    # threads and out say where a run ran, not what it computed: never listed
    assert not any("threads" in r["differs"] or "out=" in r["differs"] for r in rows)


def test_compare_prints_the_differing_settings(tmp_path, capsys):
    from privfedcal.cli.main import main

    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    (b / "config.json").write_text(json.dumps({"partition": "dirichlet", "alpha": 0.5,
                                               "clients": 10}))
    main(["compare", str(a), str(b), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "settings that differ between the runs:" in out
    assert "alpha: 0.1 (1 run), 0.5 (1 run)" in out


def test_after_calibration_is_empty_without_a_calibrator(tmp_path):
    """Only a run with a calibrator has an accuracy after calibration; CReFF (calibrates
    every round) has none before."""
    from privfedcal.report.comparison import display_rows

    runs = [fake_run(tmp_path / "avg", acc=0.37),
            fake_run(tmp_path / "ccvr", method="ccvr", calibrator="ccvr", acc=0.86, before=0.37),
            fake_run(tmp_path / "creff", method="creff", calibrator="creff", acc=0.6)]
    rows, warnings = collect(runs)
    assert [(r["accuracy_before"], r["accuracy_after"]) for r in rows] == [
        (0.37, None), (0.37, 0.86), (None, 0.6)]
    cells = [dict(zip(("before", "after"), c[5:7], strict=True)) for c in display_rows(rows)]
    assert cells == [{"before": "37.00 %", "after": "-"}, {"before": "37.00 %", "after": "86.00 %"},
                     {"before": "-", "after": "60.00 %"}]
    page = write_html(rows, warnings, tmp_path / "c.html").read_text()
    body = page.split('id="compare"')[1].split("<tbody>")[1].split("</tbody>")[0]
    shown = [re.findall(r"<td[^>]*>([^<]*)</td>", tr)[5:7] for tr in body.split("</tr>")[:-1]]
    assert shown == [["37.00 %", "-"], ["37.00 %", "86.00 %"], ["-", "60.00 %"]]


def test_a_method_alias_is_compared_as_what_it_runs(tmp_path):
    """``--method ccvr`` (config: method ccvr, calibrate none) runs fedavg + ccvr: it differs
    from ``--method fedavg --calibrate ccvr`` in nothing, and from plain fedavg in its
    calibrator, never as 'calibrate none'."""
    from privfedcal.report.comparison import differing_settings

    runs = [fake_run(tmp_path / "alias", method="ccvr", calibrator="ccvr", before=0.4),
            fake_run(tmp_path / "spelt", method="fedavg", calibrator="ccvr", before=0.4),
            fake_run(tmp_path / "plain")]
    for run, cfg in zip(runs, ({"method": "ccvr", "calibrate": "none"},
                               {"method": "fedavg", "calibrate": "ccvr"},
                               {"method": "fedavg", "calibrate": "none"}), strict=True):
        (run / "config.json").write_text(json.dumps(cfg))
    rows, _ = collect(runs[:2])
    assert differing_settings(rows) == []
    rows, _ = collect(runs)  # collect sets each row's differs
    assert [r["differs"] for r in rows] == ["", "", 'calibrate="none"']
    assert differing_settings([dict(r, differs="") for r in rows]) == [
        'calibrate: "ccvr" (2 runs), "none" (1 run)']
