"""``privfedcal attack invert|classes`` on tiny digits runs: files, attack.json schema,
the quick run when no --run is given, and bad input as one line with exit 2."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_helpers import assert_usage_error, run_cli  # noqa: F401

from privfedcal.cli.main import main
from privfedcal.privacy.transcript_files import read_entry

FAST = ["--clients", "3", "--rounds", "1", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--dataset", "digits"]
ATTACK = ["--steps", "20", "--restarts", "1"]
PNG = b"\x89PNG\r\n\x1a\n"
REQUIRED = ("target", "client", "class", "n", "psnr", "ssim", "feature_cosine",
            "nearest_is_true")
TARGETS = {"raw-feature", "class-mean", "class-stats", "class-gradient", "model-update"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("attack")
    main(["train", *FAST, "--method", "ccvr", "--out", str(root / "ccvr")])
    main(["train", *FAST, "--method", "creff", "--match-steps", "5", "--retrain-steps", "5",
          "--out", str(root / "creff")])
    return root


def check_records(path, kinds):
    records = json.loads(path.read_text())
    assert isinstance(records, list) and records
    for r in records:
        for key in REQUIRED:
            assert key in r, key
        assert r["target"] in kinds
        assert isinstance(r["n"], int) and r["n"] >= 1
        assert r["psnr"] is None or math.isfinite(r["psnr"])
        assert -1 <= r["feature_cosine"] <= 1 and 0 <= r["nearest_is_true"] <= 1
    return records


def first_held_class(run, client):
    index = json.loads((run / "server" / "transcript" / "index.json").read_text())
    (entry,) = [e for e in index if e["view"] == "plain-upload" and e["client"] == client
                and e["label"] == "ccvr-stats"]
    count = read_entry(run / "server" / "transcript", entry)["count"]
    return int(torch.nonzero(count > 0)[0])


def test_invert_stats(runs, capsys):
    run = runs / "ccvr"
    cls = first_held_class(run, 0)
    main(["attack", "invert", "--stats", "--run", str(run), *ATTACK, "--clients", "0",
          "--classes", str(cls)])
    out_dir = run / "attack-stats"
    records = check_records(out_dir / "attack.json", {"raw-feature", "class-mean", "class-stats"})
    assert {r["target"] for r in records} == {"raw-feature", "class-mean", "class-stats"}
    assert {r["client"] for r in records} == {0} and {r["class"] for r in records} == {cls}
    assert (out_dir / "reconstructions.png").read_bytes()[:8] == PNG
    assert "class-stats" in capsys.readouterr().out


def test_invert_gradients_with_update(runs, tmp_path):
    out = tmp_path / "grad"
    main(["attack", "invert", "--gradients", "--updates", "--run", str(runs / "creff"), *ATTACK,
          "--clients", "1", "--update-batch", "2", "--out", str(out)])
    records = check_records(out / "attack.json", TARGETS)
    kinds = [r["target"] for r in records]
    assert kinds[-1] == "model-update" and set(kinds[:-1]) == {"class-gradient"}
    # the recorded update of client 1: all of its images, n from the FedAvg weight
    update = records[-1]
    assert update["view"] == "plain-upload" and update["client"] == 1
    assert update["n"] == update["n_true"] == update["candidates"] > 2
    assert update["steps_run"] == 20 and (out / "reconstructions.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(("combined", "expect_rounds_job"), [(2, True), (1, False)])
def test_rounds_combined_flag(tmp_path, combined, expect_rounds_job):
    run = tmp_path / "creff2"
    main(["train", *FAST[:2], "--rounds", "2", *FAST[4:], "--method", "creff",
          "--match-steps", "5", "--retrain-steps", "5", "--out", str(run)])
    out = tmp_path / "grad"
    main(["attack", "invert", "--gradients", "--run", str(run), *ATTACK, "--clients", "1",
          "--rounds-combined", str(combined), "--out", str(out)])
    records = check_records(out / "attack.json", TARGETS | {"class-gradient-rounds"})
    rounds_rows = [r for r in records if r["target"] == "class-gradient-rounds"]
    assert bool(rounds_rows) == expect_rounds_job


def test_classes(runs, tmp_path, capsys):
    out = tmp_path / "cls"
    main(["attack", "classes", "--run", str(runs / "ccvr"), "--out", str(out)])
    records = json.loads((out / "attack.json").read_text())
    assert [r["client"] for r in records] == [0, 1, 2]
    assert all(r["accuracy"] == 1.0 and r["count_mae"] == 0.0 for r in records)
    assert (out / "classes.png").read_bytes()[:8] == PNG
    assert "precision" in capsys.readouterr().out


def test_classes_flags_come_from_its_options_type(capsys):
    """``attack classes``' inference options are ``ClassesOptions``' CLI fields: each is a
    flag with the field's help and default."""
    import dataclasses

    from privfedcal.attacks.attack_options import option_flags
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions

    fields = [f for f in option_flags(ClassesOptions) if f.cli]
    assert [f.name for f in fields] == ["false_positive_rate"]
    try:  # --help exits 0: main returns (or exits with 0)
        main(["attack", "classes", "--help"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for f in fields:
        assert f.decls[0] in shown and f"(default {f.default})" in shown
    assert dataclasses.fields(ClassesOptions)[0].default == 1e-3


def test_classes_without_run_trains_a_quick_run(tmp_path, capsys):
    out = tmp_path / "quick"
    main(["attack", "classes", "--device", "cpu", "--out", str(out)])
    cfg = json.loads((out / "run" / "config.json").read_text())
    assert (cfg["method"], cfg["dataset"]) == ("ccvr", "digits")
    records = json.loads((out / "attack.json").read_text())
    # plaintext counts: every client's class set and counts are read exactly
    assert [r["client"] for r in records] == list(range(cfg["clients"]))
    assert all(r["accuracy"] == 1.0 and r["count_mae"] == 0.0 for r in records)
    assert "quick ccvr run" in capsys.readouterr().out


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    run = str(runs / "ccvr")
    assert_usage_error(["attack", "invert", "--run", run], capsys, "--stats or --gradients")
    assert_usage_error(["attack", "invert", "--stats", "--gradients", "--run", run], capsys,
                       "exactly one")
    assert_usage_error(["attack", "invert", "--stats", "--updates", "--run", run], capsys,
                       "--updates")
    assert_usage_error(["attack", "invert", "--stats", "--run", run, "--clients", "a"], capsys,
                       "--clients")
    assert_usage_error(["attack", "invert", "--stats", "--run", run, "--clients", "9"], capsys,
                       "uploaded nothing")
    assert_usage_error(["attack", "invert", "--stats", "--run", run, "--round", "5"], capsys,
                       "round 5")
    assert_usage_error(["attack", "invert", "--stats", "--run", run, "--steps", "-1"], capsys,
                       "steps")
    assert_usage_error(["attack", "invert", "--stats", "--run", run, "--threads", "0"], capsys,
                       "--threads")
    assert_usage_error(["attack", "classes", "--run", run, "--threads", "0"], capsys,
                       "--threads")
    assert_usage_error(["attack", "invert", "--gradients", "--run", run], capsys, "creff-grad")
    assert_usage_error(["attack", "invert", "--gradients", "--run", str(runs / "creff"),
                        "--rounds-combined", "0"], capsys, "--rounds-combined")
    assert_usage_error(["attack", "classes", "--run", str(tmp_path)], capsys, "not a run folder")
    # classes' --false-positive-rate is ClassesOptions' field: its check refuses 0 and 1
    for rate in ("0", "1"):
        assert_usage_error(["attack", "classes", "--run", run, "--false-positive-rate", rate],
                           capsys, "--false-positive-rate must be in (0, 1)")
    assert_usage_error(["attack", "invert", "--stats", "--run", run, "--nope"], capsys, "nope")


# ---- earlier results, budgets, half-written output, progress ----------------------------
def test_earlier_results_are_kept_without_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "cls"
    main(["attack", "classes", "--run", str(runs / "ccvr"), "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert_usage_error(["attack", "classes", "--run", str(runs / "ccvr"), "--out", str(out)],
                       capsys, "already holds", "--overwrite")
    assert_usage_error(["attack", "invert", "--stats", "--run", str(runs / "ccvr"), *ATTACK,
                        "--clients", "0", "--out", str(out)], capsys, "attack.json")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    main(["attack", "classes", "--run", str(runs / "ccvr"), "--out", str(out), "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["attack.json", "classes.png"]


@pytest.mark.parametrize(("flags", "needle"), [
    (["--steps", "0"], "--steps >= 1"), (["--restarts", "0"], "--restarts >= 1"),
    (["--steps", "-3"], "--steps >= 1"), (["--raw-samples", "-1"], "--raw-samples"),
    (["--attack-batch", "0"], "--attack-batch must be >= 1"),
])
def test_meaningless_budgets_are_refused(runs, tmp_path, capsys, flags, needle):
    out = tmp_path / "out"
    assert_usage_error(["attack", "invert", "--stats", "--run", str(runs / "ccvr"),
                        "--clients", "0", *flags, "--out", str(out)], capsys, needle)
    assert not out.exists()


def test_an_error_half_way_writes_nothing(runs, tmp_path, capsys, monkeypatch):
    """The PNG fails after attack.json was written: neither replaces the earlier results."""
    import privfedcal.attacks.reconstruction.scoring

    out = tmp_path / "cls"
    out.mkdir()
    (out / "attack.json").write_text("earlier")

    def broken(*_a, **_k):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(privfedcal.attacks.reconstruction.scoring, "plot_class_sets", broken)
    with pytest.raises(RuntimeError, match="plot failed"):
        main(["attack", "classes", "--run", str(runs / "ccvr"), "--out", str(out),
              "--overwrite"])
    assert [p.name for p in out.iterdir()] == ["attack.json"]
    assert (out / "attack.json").read_text() == "earlier"


def test_updates_of_a_secagg_updates_run_are_not_attackable(tmp_path, capsys):
    run = tmp_path / "sa"
    main(["train", *FAST, "--secagg-updates", "--out", str(run)])
    capsys.readouterr()
    assert_usage_error(["attack", "invert", "--updates", "--run", str(run), *ATTACK], capsys,
                       "securely aggregated", "no per-client update", "only the aggregate")
    assert not (run / "attack-updates").exists()


def test_progress_on_stderr_when_piped_and_quiet_silences_it(runs, tmp_path, capsys):
    cls = first_held_class(runs / "ccvr", 0)
    args = ["attack", "invert", "--stats", "--run", str(runs / "ccvr"), *ATTACK, "--clients",
            "0", "--classes", str(cls), "--raw-samples", "1"]
    main([*args, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    stages = [x for x in err.splitlines() if x.startswith("privfedcal: attack stats:")]
    assert len(stages) >= 3, err  # planning, one per batch of targets, done
    assert "steps x restarts" in stages[-1] and "ETA" in stages[-1]
    main([*args, "--out", str(tmp_path / "b"), "--quiet"])
    assert capsys.readouterr().err == ""


def test_interrupted_attack_keeps_finished_targets_and_resumes(runs, tmp_path, capsys,
                                                                monkeypatch):
    """SIGTERM (as a scheduler or Ctrl-C's SIGINT stops it) after the first finished target:
    exit 130, one line, a partial attack.json with the finished targets; a plain rerun is
    refused, one with other settings too, and --resume runs the rest into a whole one."""
    import os
    import signal

    from privfedcal.cli import attack_command as attack_cli

    out = tmp_path / "out"
    args = ["attack", "invert", "--stats", "--run", str(runs / "ccvr"), *ATTACK,
            "--clients", "0", "--raw-samples", "1", "--attack-batch", "2", "--out", str(out)]
    shown = attack_cli.show_progress

    def stop_after_first(progress, kind, p):
        if p.targets >= 1:
            os.kill(os.getpid(), signal.SIGTERM)
        shown(progress, kind, p)

    monkeypatch.setattr(attack_cli, "show_progress", stop_after_first)
    code, printed = run_cli(args, capsys)
    assert code == 130 and "Traceback" not in printed.err, printed.err
    assert "finished targets of" in printed.err.splitlines()[-1]
    doc = json.loads((out / "attack.json").read_text())
    assert doc["partial"] is True and 1 <= doc["targets_done"] < doc["targets_planned"]
    assert len(doc["records"]) == len(doc["done"]) == doc["targets_done"]
    assert (out / "reconstructions.png").read_bytes().startswith(PNG)
    monkeypatch.setattr(attack_cli, "show_progress", shown)
    assert_usage_error(args, capsys, "partial attack", "--resume")
    assert_usage_error([*args, "--resume", "--restarts", "2"], capsys, "restarts differ")
    main([*args, "--resume"])
    records = check_records(out / "attack.json", {"raw-feature", "class-mean", "class-stats"})
    assert len(records) == doc["targets_planned"]
    assert all(r in records for r in doc["records"])  # the finished ones kept, not rerun
    assert sorted(p.name for p in out.iterdir()) == ["attack.json", "reconstructions.png"]
