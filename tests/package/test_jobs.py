"""The CLI's jobs as Python functions (privfedcal/jobs/, docs/api.md "Every job"): each on
tiny real runs, with its numbers checked against what the run folder holds; files written
only where the docstring says; bad input a one-line UsageError naming the keyword; and each
CLI command calls its job with the flags it parsed."""

from __future__ import annotations

import inspect
import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import privfedcal
from privfedcal import jobs
from privfedcal.cli.main import main
from privfedcal.errors import UsageError
from privfedcal.jobs.job_surface import Watch

FAST = dict(clients=3, rounds=2, local_epochs=1, threads=1, device="cpu", alpha=0.5)
#: a flag left in a message (``--dp-eps``), not a ``--`` inside a word or range
FLAG = re.compile(r"(?<![\w-])--[a-z]")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny real runs of the same partition: CCVR (calibrated) and FedAvg."""
    root = tmp_path_factory.mktemp("jobs")
    return (privfedcal.train(method="ccvr", out=root / "ccvr", **FAST),
            privfedcal.train(method="fedavg", out=root / "fedavg", **FAST))


def refused(call, *needles: str) -> str:
    """``call()`` raises a one-line UsageError that names keywords, never flags."""
    with pytest.raises(UsageError) as exc:
        call()
    message = str(exc.value)
    assert "\n" not in message and not FLAG.search(message), message
    for n in needles:
        assert n in message, message
    return message


# ---- each job on real runs --------------------------------------------------------------------

def test_compare_returns_the_rows_and_writes_only_into_out(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ccvr, fedavg = runs
    result = jobs.compare([ccvr, str(fedavg.path)])
    assert list(tmp_path.iterdir()) == [] and result.csv is None and result.html is None
    a, b = result.rows
    assert (a["method"], b["method"]) == ("ccvr", "fedavg")
    assert a["accuracy_after"] == ccvr.summary["accuracy"]
    assert a["accuracy_before"] == ccvr.summary["accuracy_before_calibration"]
    # FedAvg has no calibrator: its accuracy is the "before", no "after"
    assert (b["accuracy_before"], b["accuracy_after"]) == (fedavg.summary["accuracy"], None)
    assert a["curve"] == [(m["round"], m["accuracy"]) for m in ccvr.metrics]
    assert result.differing == ['calibrate: "ccvr" (1 run), "none" (1 run)']
    written = jobs.compare([ccvr, fedavg], out=tmp_path / "cmp")
    assert written.html == tmp_path / "cmp" / "compare.html" and written.html.is_file()
    assert written.rows == result.rows
    assert str(fedavg.path) in written.csv.read_text()
    refused(lambda: jobs.compare([ccvr], out=tmp_path / "cmp"), "already holds a comparison",
            "pass overwrite=True")
    (alone,) = jobs.compare([ccvr], out=tmp_path / "cmp", overwrite=True).rows
    assert alone["run"] == str(ccvr.path) and str(fedavg.path) not in written.csv.read_text()


def test_partition_is_the_runs_and_writes_only_into_out(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ccvr, _ = runs
    part = jobs.partition(ccvr.path / "config.json")
    assert part.files == () and list(tmp_path.iterdir()) == []
    exp = ccvr.experiment()
    assert [p.tolist() for p in part.indices] == [p.tolist() for p in exp.parts]
    y = exp.data.y_train.numpy()
    expected = np.stack([np.bincount(y[p.numpy()], minlength=exp.data.num_classes)
                         for p in exp.parts])
    np.testing.assert_array_equal(part.counts, expected)
    assert part.sizes == [len(p) for p in exp.parts] == part.summary["sizes"]
    # settings by keyword, numpy scalars included, override the config's
    four = jobs.partition(ccvr.config, clients=np.int64(4), out=tmp_path / "p")
    assert four.counts.shape == (4, 10) and four.summary["clients"] == 4
    assert json.loads((tmp_path / "p" / "partition.json").read_text()) == four.summary
    assert four.files == (tmp_path / "p" / "partition.png", tmp_path / "p" / "partition.json")
    refused(lambda: jobs.partition(clients=3, out=tmp_path / "p"), "already holds a partition",
            "overwrite=True")


def test_analyze_gives_the_final_heads_norms(runs, tmp_path):
    ccvr, _ = runs
    result = jobs.analyze(ccvr, samples=40, projections=8, write=False)
    assert not (ccvr.path / "analysis.json").exists() and result["plots"] == []
    head = ccvr.experiment().model.classifier.weight.detach()
    np.testing.assert_allclose(result["classifier"]["norms"]["after"],
                               torch.linalg.norm(head, dim=1).numpy(), rtol=1e-5)
    assert set(result["cka"]["mean"]) and result["separability"]["projections"] == 8
    seen = []
    jobs.analyze(ccvr.path, samples=40, projections=8, max_clients=2, progress=seen.append)
    assert json.loads((ccvr.path / "analysis.json").read_text())["cka"]["clients"] == 2
    assert seen[-1] == jobs.JobStep("retraining clients for CKA", 2, 2)


def test_write_report_writes_the_page_where_the_cli_does(runs, tmp_path):
    ccvr, _ = runs
    assert jobs.write_report(ccvr) == ccvr.path / "report.html"
    assert (ccvr.path / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert jobs.write_report(ccvr.path, out=tmp_path / "r") == tmp_path / "r" / "report.html"
    assert jobs.write_report(ccvr, out=tmp_path / "page.html").is_file()
    (tmp_path / "empty").mkdir()
    refused(lambda: jobs.write_report(tmp_path / "empty"), "holds neither a run")


def test_audit_trains_in_a_folder_it_removes_unless_out(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    small = dict(secagg=False, methods="ccvr", rounds=1, steps=5, restarts=1, clients=3)
    seen = []
    result = jobs.audit(eps=np.float64(math.inf), progress=seen.append, **small)
    assert list((tmp_path / "tmp").iterdir()) == [] and result.folder is None
    (row,) = result.rows
    assert (row["method"], row["eps"], row["secagg"]) == ("ccvr", math.inf, False)
    assert 0 < row["accuracy"] <= 1 and row["note"] == ""
    assert seen[0] == jobs.JobStep("", 0, 1) and seen[-1].done == 1
    kept = jobs.audit(eps=[math.inf], out=tmp_path / "a", **small)
    assert (tmp_path / "a" / "audit.csv").is_file()
    assert (tmp_path / "a" / "runs" / "ccvr-epsinf-secagg-off" / "summary.json").is_file()
    assert kept.rows[0]["accuracy"] == row["accuracy"]  # the same seeded run


def test_audit_dp_of_a_configuration_and_of_a_run(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = jobs.audit_dp(method="ccvr", dp_eps=1.0, dataset="digits", clients=3, rounds=1,
                           device="cpu", trials=2000, one_run=False)
    (row,) = result.rows
    assert row["channel"] == "ccvr-stats" and 0.99 < row["claimed_eps"] <= 1.0
    assert result.folder is None and list(tmp_path.iterdir()) == []
    ccvr, _ = runs
    refused(lambda: jobs.audit_dp(run=ccvr, dp_eps=3), "run audits the run's own settings",
            "dp_eps")


def test_a_job_shows_a_bar_when_interactive_and_logs_its_stages(monkeypatch, caplog):
    """As train and attack: a bar by default when interactive (none with progress=False),
    the caller's callable instead where given, and INFO lines on the privfedcal logger."""
    from privfedcal.api import log as api_log

    bars = []

    class FakeBar:
        def __init__(self, description, total, completed=0):
            self.opened, self.updates, self.closed = (description, total, completed), [], False
            bars.append(self)

        def update(self, completed, total, info):
            self.updates.append((completed, total, info))

        def close(self):
            self.closed = True

    monkeypatch.setattr(api_log, "TerminalBar", FakeBar)
    monkeypatch.setattr(api_log, "in_notebook", lambda: False)
    monkeypatch.setattr(api_log, "interactive", lambda: True)
    stages = [jobs.JobStep("", 0, 2), jobs.JobStep("a: training", 0, 2), jobs.JobStep("a: done", 1, 2)]
    caplog.set_level("INFO", logger="privfedcal")
    with Watch(None, "audit") as watch:
        for st in stages:
            watch(st)
    (bar,) = bars
    assert bar.opened == ("audit", 2, 0) and bar.closed
    assert bar.updates == [(0, 2, ""), (0, 2, "a: training"), (1, 2, "a: done")]
    assert [r.getMessage() for r in caplog.records] == [
        "audit: started", "audit: a: training", "audit: a: done", "audit: done"]
    seen = []
    for progress in (False, seen.append):
        with Watch(progress, "audit") as watch:
            for st in stages:
                watch(st)
    assert len(bars) == 1 and seen == stages


# ---- bad input: one line, in keywords ---------------------------------------------------------

def test_bad_input_names_the_keyword(runs, tmp_path):
    ccvr, _ = runs
    run = ccvr.path
    cases = [
        (lambda: jobs.compare([]), ["runs"]),
        (lambda: jobs.compare(5), ["runs must be run folders"]),
        (lambda: jobs.compare([run], overwrite="yes"), ["overwrite must be True or False"]),
        (lambda: jobs.compare([run], out=tmp_path / "c", verbose=True), ["verbose"]),
        (lambda: jobs.analyze(run, samples=1), ["samples must be >= 2"]),
        (lambda: jobs.analyze(run, max_clients=1), ["max_clients must be >= 2"]),
        (lambda: jobs.analyze(run, samples=2.5), ["samples must be an integer"]),
        (lambda: jobs.audit(eps=[0.0]), ["every eps must be > 0"]),
        (lambda: jobs.audit(eps="x"), ["eps[0] must be a number"]),
        (lambda: jobs.audit(methods="fedavg"), ["methods: fedavg", "no calibration payload"]),
        (lambda: jobs.audit(attack_batch=0), ["attack_batch must be >= 1"]),
        (lambda: jobs.audit_dp(method="ccvr", dp_eps=1, budget_s=0), ["budget_s must be"]),
        (lambda: jobs.audit_dp(method="ccvr", dp_eps=1, trials=3), ["trials must be"]),
        (lambda: jobs.audit_dp(method="ccvr", channels="x"), ["channels takes names among"]),
        (lambda: jobs.audit_dp(method="fedavg"), ["no channel", "dp_train=True"]),
        (lambda: jobs.audit_dp(run=tmp_path / "none"), ["no such run folder"]),
        (lambda: jobs.partition(alpha=0), ["alpha"]),
        (lambda: jobs.partition(method="ccvr"), ["partition takes no setting method"]),
        (lambda: jobs.partition(clients="many"), ["clients must be an integer"]),
        (lambda: jobs.write_report(run, out=3), ["out must be a path"]),
        (lambda: jobs.write_report(tmp_path / "none"), ["is not a folder"]),
        (lambda: jobs.analyze(run, progress="bar"), ["progress must be callable"]),
    ]
    if Path("/proc").is_dir():  # refuses new entries, whatever the permission bits say
        cases += [(lambda: jobs.compare([run], out="/proc/x"), ["cannot write to out /proc/x"]),
                  (lambda: jobs.partition(out="/proc/x"), ["cannot write to out /proc/x"])]
    for call, needles in cases:
        refused(call, *needles)



def _both_readers(tmp: Path) -> dict[str, tuple]:
    """For a message of each job that names one of its options: the job's call, the command
    line that meets the same check, the keyword the job's message names and the flag the
    command's names (one template, written for each reader)."""
    dp = ["audit", "dp", "--method", "ccvr", "--dp-eps", "1"]
    return {
        "audit-methods": (lambda: jobs.audit(methods="fedavg"), ["audit", "--methods", "fedavg"],
                          "methods: fedavg", "--methods: fedavg"),
        "audit-attack-clients": (lambda: jobs.audit(attack_clients=0),
                                 ["audit", "--attack-clients", "0"],
                                 "attack_clients must be >= 1", "--attack-clients must be >= 1"),
        "audit-overwrite": (lambda: jobs.audit(methods="ccvr", out=tmp / "audit"),
                            ["audit", "--methods", "ccvr", "--out", str(tmp / "audit")],
                            "pass overwrite=True", "pass --overwrite"),
        "audit-dp-budget": (lambda: jobs.audit_dp(method="ccvr", dp_eps=1, budget_s=0),
                            [*dp, "--budget-s", "0"], "budget_s must be", "--budget-s must be"),
        "audit-dp-trials": (lambda: jobs.audit_dp(method="ccvr", dp_eps=1, trials=3),
                            [*dp, "--trials", "3"], "trials must be", "--trials must be"),
        "audit-dp-confidence": (lambda: jobs.audit_dp(method="ccvr", dp_eps=1, confidence=2),
                                [*dp, "--confidence", "2"], "confidence must be in",
                                "--confidence must be in"),
        "audit-dp-channels": (lambda: jobs.audit_dp(method="ccvr", dp_eps=1, channels="x"),
                              [*dp, "--channels", "x"], "channels takes", "--channels takes"),
        "analyze-samples": (lambda: jobs.analyze(tmp, samples=1),
                            ["analyze", str(tmp), "--samples", "1"], "samples must be >= 2",
                            "--samples must be >= 2"),
        "analyze-max-clients": (lambda: jobs.analyze(tmp, max_clients=1),
                                ["analyze", str(tmp), "--max-clients", "1"],
                                "max_clients must be >= 2", "--max-clients must be >= 2"),
        "compare-overwrite": (lambda: jobs.compare([tmp], out=tmp / "compare"),
                              ["compare", str(tmp), "--out", str(tmp / "compare")],
                              "pass overwrite=True to replace them, or out another folder",
                              "pass --overwrite to replace them, or --out another folder"),
        "partition-overwrite": (lambda: jobs.partition(out=tmp / "partition"),
                                ["partition", "--out", str(tmp / "partition")],
                                "pass overwrite=True", "pass --overwrite"),
        "report-out": (lambda: jobs.write_report(tmp, out="/proc/x/r.html"),
                       ["report", str(tmp), "--out", "/proc/x/r.html"],
                       "cannot write to out /proc/x", "cannot write to --out /proc/x"),
    }


#: the folders ``_both_readers``' calls find earlier results in
_HELD = {"compare": "compare.csv", "partition": "partition.json", "audit": "audit.csv"}


@pytest.mark.parametrize("case", sorted(_both_readers(Path("tmp"))))
def test_a_jobs_message_names_keywords_in_python_and_flags_in_the_cli(case, tmp_path, capsys):
    """The options a job's message names come from their declaration: keywords from the
    job, the same check's flags from its command (no flag rewritten into a keyword)."""
    for name, file in _HELD.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text("earlier")
    call, argv, keyword, flag = _both_readers(tmp_path)[case]
    if case == "report-out" and not Path("/proc").is_dir():
        pytest.skip("no /proc to refuse new entries")
    message = refused(call, keyword)
    assert "--" not in message, message
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in " ".join(err.split()), err


# ---- the CLI is a layer over the jobs ---------------------------------------------------------

def _cli_calls(run: str, out: str) -> dict[str, tuple[list[str], dict]]:
    """For each job, a command line and the arguments its half for the CLI must receive."""
    return {
        "compare": (["compare", run, "--out", out, "--overwrite"],
                    {"runs": [Path(run)], "out": Path(out), "overwrite": True}),
        "analyze": (["analyze", run, "--samples", "7", "--max-clients", "2", "--quiet"],
                    {"run_dir": Path(run), "samples": 7, "projections": 256, "max_clients": 2,
                     "device": None}),
        "audit": (["audit", "--eps", "1,inf", "--secagg", "off", "--methods", "ccvr",
                   "--rounds", "1", "--out", out, "--quiet"],
                  {"out": Path(out), "overwrite": False}),
        "audit_dp": (["audit", "dp", "--method", "ccvr", "--dp-eps", "1", "--trials", "2000",
                      "--no-one-run", "--out", out, "--quiet"],
                     {"out": Path(out), "trials": 2000, "one_run": False, "channels": None}),
        "partition": (["partition", "--clients", "4", "--out", out],
                      {"config": None, "out": Path(out), "overwrite": False}),
        "write_report": (["report", run, "--out", out], {"folder": Path(run), "out": Path(out)}),
    }


def test_every_job_has_a_cli_command_in_this_test():
    functions = {n for n in jobs.__all__ if inspect.isfunction(getattr(jobs, n))}
    assert functions == set(_cli_calls("r", "o"))


@pytest.mark.parametrize("name", sorted(_cli_calls("r", "o")))
def test_each_cli_command_calls_its_job(name, tmp_path, capsys, monkeypatch):
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    argv, expected = _cli_calls(run, out)[name]
    half = getattr(jobs, f"{name}_for_cli")
    calls = []

    def recorder(*args, **kwargs):
        calls.append(inspect.signature(half).bind(*args, **kwargs).arguments)
        raise UsageError("recorded")

    monkeypatch.setattr(jobs, f"{name}_for_cli", recorder)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "recorded" in capsys.readouterr().err
    (got,) = calls
    for key, value in expected.items():
        assert got[key] == value, (key, got[key])
    if name == "audit":  # the grid parsed from the flags
        assert (got["config"].eps, got["config"].secagg, got["config"].methods,
                got["config"].rounds) == ((1.0, math.inf), (False,), ("ccvr",), 1)
    if name == "audit_dp":
        assert (got["cfg"].method, got["cfg"].privacy.dp_eps) == ("ccvr", 1.0)
    if name == "partition":
        assert got["settings"]["clients"] == 4


def test_the_jobs_progress_record_is_jobstep_and_stage_a_deprecated_alias():
    """The jobs' progress record is ``privfedcal.JobStep``, a class apart from the uplink's
    ``privacy.stages.Stage``; ``privfedcal.Stage`` still gives it, with a warning."""
    import privfedcal
    from privfedcal.privacy.stages import Stage as PipelineStage

    assert privfedcal.JobStep is jobs.JobStep and privfedcal.JobStep is not PipelineStage
    assert "Stage" not in privfedcal.__all__
    with pytest.warns(DeprecationWarning, match="privfedcal.JobStep"):
        assert privfedcal.Stage is privfedcal.JobStep
