"""The CLI contract of ``train``: every name checked in every section, type errors one line,
a run's config.json re-runs it, defaults resolved and recorded, divergence exit code 4,
``--resume --rounds`` extends a run to the uninterrupted run's model."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_usage_error, run_cli
from safetensors.torch import load_file

from privfedcal.cli.main import main
from privfedcal.settings.run_config import TRAINING_DEFAULTS, RunConfig, resolve_training_defaults

FAST = ["--clients", "4", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--no-transcript"]


def toml(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


# ---- names and types ---------------------------------------------------------------------
@pytest.mark.parametrize("body, needles", [
    ('method = "ccvr"\n[calibration_params]\nvirtual_per_clas = 50\n',
     ["virtual_per_clas", "virtual_per_class"]),
    ('rounds = 1\nlearning_rate = 0.1\n', ["learning_rate", "lr"]),
    ('[method_params]\nmu = 0.1\n', ["fedavg", "mu"]),
    ('method = "creff"\n[calibration_params]\nvirtual_per_class = 5\n',
     ["creff", "features_per_class"]),
])
def test_unknown_names_in_every_section(tmp_path, capsys, body, needles):
    out = tmp_path / "run"
    assert_usage_error(["train", *FAST, "--config", toml(tmp_path, body), "--out", str(out)],
                       capsys, *needles)
    assert not out.exists()


def test_hyphenated_section_keys_are_the_flag_names(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", *FAST, "--config",
          toml(tmp_path, 'method = "ccvr"\n[calibration_params]\nvirtual-per-class = 7\n'),
          "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calibration"]["virtual_features"] == 10 * 7  # the value was used


@pytest.mark.parametrize("body, needle", [
    ('rounds = "3"\n', "rounds must be an integer"),
    ('lr = "fast"\n', "lr must be a number"),
    ('secagg = 1\n', "secagg must be true or false"),
    ('method_params = 3\n', "method_params"),
])
def test_type_errors_are_one_line(tmp_path, capsys, body, needle):
    assert_usage_error(["train", "--config", toml(tmp_path, body)], capsys, needle)


def test_calibration_flags_need_a_calibrator(tmp_path, capsys):
    assert_usage_error(["train", *FAST, "--virtual-per-class", "50"], capsys,
                       "virtual-per-class", "--calibrate")
    assert_usage_error(["train", *FAST, "--calibrate", "ccvr", "--match-steps", "5"], capsys,
                       "ccvr", "match_steps")


@pytest.mark.parametrize("args", [["--method", "creff", "--calibrate", "ccvr"],
                                  ["--method", "ccvr", "--calibrate", "creff"],
                                  ["--method", "creff", "--calibrate", "oracle:10"]])
def test_alias_with_another_calibrator_is_refused(capsys, args):
    assert_usage_error(["train", *FAST, *args], capsys, "--method fedavg --calibrate")


@pytest.mark.parametrize("args", [["--model", "vgg99"],
                                  ["--dataset", "cifar10", "--data-root", "/nonexistent"]])
def test_failure_before_training_leaves_no_folder(tmp_path, capsys, args):
    out = tmp_path / "run"
    assert_usage_error(["train", *FAST, *args, "--out", str(out)], capsys)
    assert not out.exists()


# ---- defaults ------------------------------------------------------------------------------
def test_defaults_table_resolution():
    cfg = resolve_training_defaults(RunConfig.of(dataset="cifar10", model="resnet18"), model="cnn",
                                    augment=True)
    assert (cfg.training.lr, cfg.training.momentum, cfg.training.weight_decay, cfg.training.batch_size, cfg.training.local_epochs) == \
        (0.01, 0.9, 1e-5, 64, 10)
    assert cfg.model == "resnet18" and cfg.data.augment is True
    digits = resolve_training_defaults(RunConfig(), model="mlp", augment=False)
    assert (digits.model, digits.training.lr, digits.training.batch_size, digits.training.local_epochs, digits.data.augment) \
        == ("mlp", 0.05, 32, 2, False)
    given = resolve_training_defaults(RunConfig.of(lr=0.3, batch_size=8, augment=True),
                                      model="cnn", augment=False)
    assert (given.training.lr, given.training.batch_size, given.data.augment) == (0.3, 8, True)  # the user's values win
    assert given.training.momentum == TRAINING_DEFAULTS["paper"]["momentum"]


def test_run_records_resolved_settings_partition_and_bytes(tmp_path, capsys):
    out = tmp_path / ("run-with-a-long-name-" * 6)
    main(["train", *FAST, "--out", str(out)])
    io = capsys.readouterr()
    assert str(out) in io.out and "…" not in io.out  # piped: never truncated nor wrapped
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"] == "mlp" and cfg["lr"] == 0.05 and cfg["batch_size"] == 32
    assert cfg["augment"] is False and cfg["local_epochs"] == 1
    assert "model mlp, lr 0.05" in io.out                  # the resolved line at start
    part = json.loads((out / "private" / "partition.json").read_text())
    assert part["clients"] == 4 and len(part["indices"]) == 4
    assert sum(len(i) for i in part["indices"]) == part["num_assigned"] == sum(part["sizes"])
    summary = json.loads((out / "summary.json").read_text())
    params = sum(v.numel() for v in load_file(str(out / "final" / "state.safetensors")).values())
    assert summary["model_update_bytes"] == 2 * 4 * 4 * params  # rounds x clients x float32
    assert summary["calibration_upload_bytes"] == 0
    assert "model updates uploaded (bytes)" in io.out and "calibration uploads (bytes)" in io.out
    # stderr is not a terminal here: one progress line per evaluated round on it, no bar
    assert [x.split(":")[0] for x in io.err.splitlines() if x.startswith("round")] == \
        ["round 1/2", "round 2/2"]


def test_model_too_big_for_the_input_warns(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", *FAST, "--rounds", "1", "--model", "resnet8", "--out", str(out)])
    err = capsys.readouterr().err
    assert "warning: model resnet8" in err and "8x8" in err
    assert any("resnet8" in n for n in json.loads((out / "summary.json").read_text())["notes"])


def test_config_json_reruns_a_run(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    main(["train", *FAST, "--lr", "0.02", "--out", str(a)])
    main(["train", "--config", str(a / "config.json"), "--out", str(b)])
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["accuracy"] == sb["accuracy"]
    cb = json.loads((b / "config.json").read_text())
    assert cb["lr"] == 0.02 and cb["out"] == str(b)


def test_help_shows_defaults_and_choices(capsys):
    try:
        main(["train", "--help"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    for name in ("fedprox", "moon", "resnet18", "mobilenetv2", "imagefolder:PATH", "oracle"):
        assert name in text, name
    assert "default: (0.1)" in text or "default: 0.1" in text  # --alpha shows its default


# ---- divergence ------------------------------------------------------------------------------
def test_exploding_run_exits_4_with_one_error_line(tmp_path, capsys):
    out = tmp_path / "run"
    code, io = run_cli(["train", *FAST, "--lr", "50", "--out", str(out)], capsys)
    assert code == 4
    errors = [x for x in io.err.splitlines() if x.startswith("privfedcal: error:")]
    assert len(errors) == 1 and "round 1" in errors[0] and "--lr" in errors[0]
    # it says what it kept, truly: round 1 never finished, so there is no checkpoint
    assert "no checkpoint was kept" in errors[0] and "checkpoint of round" not in errors[0]
    assert not (out / "checkpoint").exists()
    assert "Traceback" not in io.err and "accuracy" not in io.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"]["round"] == 1 and summary["accuracy"] is None
    assert_usage_error(["train", "--resume", str(out)], capsys, "diverged")


# ---- resume ----------------------------------------------------------------------------------
def _final(run):
    return load_file(str(run / "final" / "state.safetensors"))


@pytest.mark.parametrize("extra", [[], ["--method", "ccvr"]])
def test_resume_extends_to_the_uninterrupted_model(tmp_path, capsys, extra):
    short, full = tmp_path / "short", tmp_path / "full"
    main(["train", *FAST, *extra, "--out", str(short)])
    main(["train", *FAST, *extra, "--rounds", "3", "--out", str(full)])
    main(["train", "--resume", str(short), "--rounds", "3"])
    a, b = _final(short), _final(full)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    s = json.loads((short / "summary.json").read_text())
    assert s["rounds"] == 3 and any("extended from 2 to 3" in n for n in s["notes"])
    assert json.loads((short / "config.json").read_text())["rounds"] == 3
    metrics = [json.loads(x)["round"] for x in (short / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3]
    if extra:
        assert any("post-hoc" in n for n in s["notes"])


def test_resume_refuses_other_flags_and_fewer_rounds(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", *FAST, "--out", str(out)])
    capsys.readouterr()
    assert_usage_error(["train", "--resume", str(out), "--rounds", "3", "--lr", "0.1"], capsys,
                       "--lr", "--rounds")
    assert_usage_error(["train", "--resume", str(out), "--rounds", "1"], capsys, ">= 2")
    assert_usage_error(["train", "--resume", str(out), "--rounds", "2"], capsys,
                       "already complete")


def test_resume_refuses_new_rounds_under_dp(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    cfg = RunConfig.of(dp_eps=4.0, rounds=2, out=str(run)).to_dict()
    (run / "config.json").write_text(json.dumps(cfg))
    assert_usage_error(["train", "--resume", str(run), "--rounds", "5"], capsys, "DP")


def test_divergence_message_names_the_kept_checkpoint():
    from privfedcal.cli.main import diverged_kept
    from privfedcal.errors import Diverged

    exc = Diverged(3, "the test loss is not finite")
    assert diverged_kept(exc) == "summary.json marks the run diverged"  # unknown: no claim
    exc.checkpoint_round = 2
    assert "checkpoint of round 2" in diverged_kept(exc)
    exc.checkpoint_round = 0
    assert "no checkpoint was kept" in diverged_kept(exc)
