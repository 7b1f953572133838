"""``privfedcal train`` end to end, and every kind of bad input: one line, exit 2."""

from __future__ import annotations

import json

from cli_helpers import assert_usage_error, run_cli  # noqa: F401

from privfedcal.cli.main import main

FAST = ["--clients", "4", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--no-transcript"]


def test_train_writes_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", *FAST, "--out", str(out)])
    for name in ("config.json", "metrics.jsonl", "summary.json", "accuracy.png"):
        assert (out / name).is_file(), name
    assert (out / "checkpoint").is_dir()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method"] == "fedavg" and cfg["seed"] == 0 and "versions" in cfg
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["method"], summary["dataset"], summary["model"], summary["rounds"]) == (
        "fedavg", "digits", "mlp", 2)
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2]
    assert summary["accuracy"] == history[-1]["accuracy"]
    assert summary["per_class_accuracy"] == history[-1]["per_class_accuracy"]
    # the summary's numbers are the checkpointed global model's, evaluated independently
    from privfedcal.experiment import build_experiment
    from privfedcal.federation.checkpoint import load_checkpoint
    from privfedcal.federation.local import evaluate
    from privfedcal.settings.run_config import read_run_config

    exp = build_experiment(read_run_config(out))
    ev = evaluate(exp.model, load_checkpoint(out / "checkpoint")["global"], exp.data.x_test,
                  exp.data.y_test, exp.data.num_classes)
    assert ev["accuracy"] == summary["accuracy"] and ev["loss"] == summary["loss"]
    assert ev["per_class_accuracy"] == summary["per_class_accuracy"]
    assert f"{summary['accuracy']:.4f}"[:4] in capsys.readouterr().out


def test_config_file_and_flag_override(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text('method = "fedprox"\nrounds = 1\nclients = 4\n[method_params]\nmu = 0.1\n')
    out = tmp_path / "run"
    main(["train", "--config", str(conf), "--rounds", "2", "--local-epochs", "1",
          "--device", "cpu", "--threads", "1", "--no-transcript", "--out", str(out)])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method"] == "fedprox" and cfg["rounds"] == 2
    assert cfg["method_params"] == {"mu": 0.1}


def test_resume_cli(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", *FAST, "--out", str(out)])
    capsys.readouterr()  # the run's progress lines
    assert_usage_error(["train", "--resume", str(out)], capsys, "already complete")


def test_unknown_method_lists_choices(capsys):
    assert_usage_error(["train", "--method", "nope"], capsys, "fedavg", "moon", "ccvr")


def test_unknown_dataset_lists_choices(capsys):
    assert_usage_error(["train", "--dataset", "mnist"], capsys, "digits", "cifar10")


def test_unknown_model_lists_choices(capsys):
    assert_usage_error(["train", *FAST, "--model", "vgg99"], capsys, "mlp")


def test_alpha_must_be_positive(capsys):
    assert_usage_error(["train", "--alpha", "0"], capsys, "alpha")
    assert_usage_error(["train", "--alpha", "-1"], capsys, "alpha")


def test_more_clients_than_samples(capsys):
    assert_usage_error(["train", "--clients", "100000"], capsys, "client")


def test_missing_data_root(tmp_path, capsys):
    assert_usage_error(["train", "--dataset", "cifar10", "--data-root", str(tmp_path / "none")],
                       capsys, "cifar")


def test_unreadable_config(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    assert_usage_error(["train", "--config", str(bad)], capsys, "TOML")
    assert_usage_error(["train", "--config", str(tmp_path / "missing.toml")], capsys, "exist")


def test_unknown_flag_is_one_line(capsys):
    assert_usage_error(["train", "--no-such-flag"], capsys)


def test_unknown_hyperparameter_for_method(capsys):
    assert_usage_error(["train", *FAST, "--tau", "0.5"], capsys, "tau")


def test_unwritable_out_is_one_line_before_any_work(tmp_path, capsys):
    """Under a file (or a read-only folder): refused before data load, nothing created."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_usage_error(["train", *FAST, "--out", str(blocker / "run")], capsys,
                       "cannot write to --out", "not a folder")
    assert_usage_error(["partition", "--clients", "4", "--out", str(blocker / "part")],
                       capsys, "cannot write to --out")
    assert blocker.read_text() == "x"


def test_read_only_out_is_one_line(tmp_path, capsys):
    import os

    import pytest

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert_usage_error(["train", *FAST, "--out", str(ro / "run")], capsys, "not writable")


def test_a_write_error_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    import privfedcal.cli.run_progress

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(privfedcal.cli.run_progress, "execute", disk_full)
    code, out = run_cli(["train", *FAST, "--out", str(tmp_path / "run")], capsys)
    assert code == 1 and "Traceback" not in out.err
    assert out.err.strip().splitlines() == [
        f"privfedcal: error: No space left on device: {tmp_path / 'run' / 'metrics.jsonl'}"]


def test_client_batch_trains_the_same_model(tmp_path, capsys):
    """``--client-batch 3``: the run's config records it and the final model is the
    sequential run's (fp32 rounding); the resumable checkpoint is written as usual."""
    import torch

    from privfedcal.federation.checkpoint import load_checkpoint

    finals = []
    for k in ("1", "3"):
        out = tmp_path / k
        main(["train", *FAST, "--method", "fedprox", "--client-batch", k, "--out", str(out)])
        assert json.loads((out / "config.json").read_text())["client_batch"] == int(k)
        finals.append(load_checkpoint(out / "checkpoint")["global"])
    for key, v in finals[0].items():
        torch.testing.assert_close(finals[1][key], v, rtol=1e-4, atol=2e-5)


def test_client_batch_refusals(tmp_path, capsys):
    assert_usage_error(["train", *FAST, "--client-batch", "2", "--model", "resnet8",
                        "--out", str(tmp_path / "a")], capsys, "BatchNorm", "--client-batch")
    assert_usage_error(["train", *FAST, "--client-batch", "2", "--workers", "2",
                        "--out", str(tmp_path / "b")], capsys, "--workers 1")
    assert_usage_error(["train", *FAST, "--client-batch", "2", "--dp-train", "--dp-eps", "8",
                        "--out", str(tmp_path / "c")], capsys, "--dp-train")
    assert not any((tmp_path / d).exists() for d in "abc")
