"""``privfedcal compare``: an earlier comparison in ``--out`` is kept unless ``--overwrite``
(one line, exit 2), as ``attack`` and ``audit`` keep theirs."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import assert_usage_error, run_cli

from privfedcal.cli.main import main


def fake_run(path: Path, acc: float) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({
        "method": "fedavg", "calibrator": "none", "dataset": "digits", "rounds": 1,
        "accuracy": acc, "per_class_accuracy": [acc], "wall_seconds": 1.0}))
    (path / "config.json").write_text(json.dumps({"partition": "iid", "clients": 2}))
    (path / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": acc}) + "\n")
    return path


def test_compare_refuses_to_replace_an_earlier_comparison(tmp_path, capsys):
    a, b = fake_run(tmp_path / "a", 0.25), fake_run(tmp_path / "b", 0.75)
    out = tmp_path / "out"
    main(["compare", str(a), "--out", str(out)])
    capsys.readouterr()
    before = {n: (out / n).read_text() for n in ("compare.csv", "compare.html")}
    assert_usage_error(["compare", str(a), str(b), "--out", str(out)], capsys,
                       "already holds a comparison", "--overwrite")
    assert {n: (out / n).read_text() for n in before} == before
    main(["compare", str(a), str(b), "--out", str(out), "--overwrite"])
    assert str(b) in (out / "compare.csv").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare.html"]


def test_compare_default_out_is_kept_too(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = fake_run(tmp_path / "a", 0.5)
    main(["compare", str(a)])
    assert (tmp_path / "runs" / "compare" / "compare.csv").is_file()
    assert_usage_error(["compare", str(a)], capsys, "runs/compare already holds")


def test_compare_failing_half_way_leaves_the_earlier_files(tmp_path, capsys, monkeypatch):
    import privfedcal.report.comparison

    a = fake_run(tmp_path / "a", 0.5)
    out = tmp_path / "out"
    main(["compare", str(a), "--out", str(out)])
    capsys.readouterr()
    csv = (out / "compare.csv").read_text()

    def broken(*_a, **_k):
        raise OSError(28, "No space left on device", str(out / "compare.partial.html"))

    monkeypatch.setattr(privfedcal.report.comparison, "write_html", broken)
    code, err = run_cli(["compare", str(a), "--out", str(out), "--overwrite"], capsys)
    assert code == 1 and "Traceback" not in err.err
    assert (out / "compare.csv").read_text() == csv
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare.html"]


def test_a_damaged_metrics_file_is_one_line_not_a_traceback(tmp_path, capsys):
    """A metrics.jsonl that is not JSON lines: compare and report name it, exit 2."""
    a = fake_run(tmp_path / "a", 0.5)
    with (a / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "accur')  # cut off mid-line
    assert_usage_error(["compare", str(a), "--out", str(tmp_path / "c")], capsys,
                       "metrics.jsonl is not valid JSON", "line 2")
    assert_usage_error(["report", str(a)], capsys, "metrics.jsonl is not valid JSON")
    assert not (tmp_path / "c").exists()
