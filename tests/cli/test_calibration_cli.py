"""``privfedcal train`` with calibration, end to end on digits: CCVR (post hoc), CReFF (every
round), the oracle (``--calibrate oracle:N``) and a bad ``--calibrate`` name."""

from __future__ import annotations

import contextlib
import json

import pytest

from privfedcal.cli.main import main

FAST = ["--clients", "4", "--rounds", "3", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--no-transcript"]
CHANCE = 0.1  # 10 balanced digit classes in the test split


def train(tmp_path, *args: str) -> dict:
    out = tmp_path / "run"
    main(["train", *FAST, *args, "--out", str(out)])
    return json.loads((out / "summary.json").read_text())


def test_ccvr_reports_accuracy_before_and_after(tmp_path, capsys):
    s = train(tmp_path, "--method", "ccvr", "--virtual-per-class", "50")
    assert s["method"] == "ccvr" and s["local_method"] == "fedavg" and s["calibrator"] == "ccvr"
    cal = s["calibration"]
    assert cal["name"] == "ccvr" and cal["present_classes"] == 10
    assert cal["virtual_features"] == 10 * 50      # balanced: M per present class
    # the run's final accuracy is the calibrated model's, recorded once more in "calibration"
    assert s["accuracy"] == cal["accuracy_after"]
    for key in ("accuracy", "accuracy_before_calibration"):
        assert CHANCE + 0.3 < s[key] <= 1.0, (key, s[key])
    # CCVR re-trains the head of the trained FedAvg model: it must not wreck it
    assert s["accuracy"] > s["accuracy_before_calibration"] - 0.1
    assert len(s["per_class_accuracy"]) == len(s["per_class_accuracy_before_calibration"]) == 10
    out = capsys.readouterr().out
    assert "accuracy before calibration" in out


def test_ccvr_before_calibration_is_the_fedavg_run(tmp_path, capsys):
    """Same seed, same training: CCVR's uncalibrated model is exactly plain FedAvg's."""
    ccvr = train(tmp_path / "a", "--method", "ccvr")
    fedavg = train(tmp_path / "b", "--method", "fedavg")
    assert ccvr["accuracy_before_calibration"] == fedavg["accuracy"]
    assert "accuracy_before_calibration" not in fedavg


def test_creff_runs_and_records_every_round(tmp_path, capsys):
    s = train(tmp_path, "--method", "creff", "--match-steps", "10", "--retrain-steps", "20")
    assert s["calibrator"] == "creff" and s["local_method"] == "fedavg"
    assert "accuracy_before_calibration" not in s      # CReFF has no post-hoc step
    assert s["creff_dsa"] == "color_crop_cutout_flip_scale_rotate"  # the authors' default
    rounds = [json.loads(line) for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[-1]["accuracy"] == s["accuracy"]      # the run returns v_hat's model
    for r in rounds:
        info = r["calibration"]
        assert info["name"] == "creff" and info["matched_classes"] == 10
        # gradient matching decreases the matching loss of Eq. 6 within a round
        assert info["match_loss_after"] < info["match_loss_before"]


def test_creff_without_augmentation_is_recorded(tmp_path, capsys):
    s = train(tmp_path, "--method", "creff", "--match-steps", "2", "--retrain-steps", "2",
              "--creff-dsa", "none")
    assert s["creff_dsa"] == "none"
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["calibration_params"]["creff_dsa"] == "none"


def test_creff_reaches_a_sane_accuracy(tmp_path, capsys):
    """10 matching / 20 re-training steps leave S near its N(0, 1) start (about chance after 3
    rounds, measured 14%); I = J = 100 moves it far enough: measured 74% after 3 rounds,
    against 78% for the FedAvg head of the same run."""
    s = train(tmp_path, "--method", "creff", "--match-steps", "100", "--retrain-steps", "100")
    assert 0.5 < s["accuracy"] <= 1.0, s["accuracy"]


def test_oracle_with_per_class_cap(tmp_path, capsys):
    s = train(tmp_path, "--calibrate", "oracle:20")
    assert s["calibrator"] == "oracle:20"
    cal = s["calibration"]
    assert cal["name"] == "oracle" and cal["per_class"] == 20
    assert cal["real_features"] == 10 * 20      # every digit class has >= 20 training samples
    assert s["accuracy"] == cal["accuracy_after"]
    assert CHANCE + 0.3 < s["accuracy"] <= 1.0


@pytest.mark.parametrize("spec, needle", [("bogus", "ccvr"), ("oracle:x", "integer")])
def test_bad_calibrate_is_one_line_exit_2(spec, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *FAST, "--calibrate", spec, "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


def test_help_lists_every_calibrate_form(capsys):
    """Every ``NAME:N`` a calibrator takes (its ``arg_field``) is in ``train --help``."""
    import privfedcal.calibration  # noqa: F401
    from privfedcal.federation.hooks import CALIBRATORS

    with contextlib.suppress(SystemExit):  # help exits 0 (or returns)
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    forms = [f"{n}[:N]" if hasattr(CALIBRATORS.get(n), "arg_field") else n
             for n in CALIBRATORS.names()]
    assert set(forms) == {"none", "ccvr[:N]", "creff[:N]", "oracle[:N]"}
    for form in forms:
        assert form in text, form
    assert "--virtual-per-class" in text.split("--calibrate", 1)[1].split("--virtual-mode")[0]


def test_calibrate_n_is_the_calibrators_per_class_count():
    """``ccvr:N`` = ``--virtual-per-class N``, ``creff:N`` = ``--features-per-class N``."""
    from privfedcal.calibration import CCVR, CReFF, calibrator_params
    from privfedcal.federation.hooks import CalibrationSpec

    assert calibrator_params(CCVR, CalibrationSpec("ccvr", 7), {}).virtual_per_class == 7
    assert calibrator_params(CReFF, CalibrationSpec("creff", 9), {}).features_per_class == 9


@pytest.mark.parametrize("args, needle", [
    (["--calibrate", "ccvr:"], "integer"),
    (["--calibrate", "none:3"], "takes no ':N'"),
    (["--calibrate", "ccvr:7", "--virtual-per-class", "20"], "give one of them"),
    (["--calibrate", "creff:7", "--features-per-class", "20"], "give one of them"),
])
def test_calibrate_n_refusals_before_any_work(args, needle, tmp_path, capsys, monkeypatch):
    import privfedcal.cli.run_progress

    def never(*_a, **_k):
        raise AssertionError("the run started")

    monkeypatch.setattr(privfedcal.cli.run_progress, "execute", never)
    with pytest.raises(SystemExit) as exc:
        main(["train", *FAST, *args, "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "run").exists()
