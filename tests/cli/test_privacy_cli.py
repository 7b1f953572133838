"""The design card's commands: DP, secure aggregation and hidden counts end to end."""

from __future__ import annotations

import json
import warnings

import pytest
from opacus.accountants import RDPAccountant

from privfedcal.cli.main import main
from privfedcal.privacy.transcript import load_transcript

FAST = ["--clients", "4", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5"]


def summary(path):
    return json.loads((path / "summary.json").read_text())


def assert_epsilon_is_opacus(p, target):
    """The reported epsilon is opacus's RDP accountant stepped through the reported
    releases one step at a time, and the planned noise spends the budget tightly."""
    acc = RDPAccountant()
    for r in p["releases"]:
        for _ in range(r["steps"]):
            acc.step(noise_multiplier=r["noise_multiplier"], sample_rate=r["sample_rate"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = acc.get_epsilon(delta=p["delta"])
    assert p["accountant"] == "rdp" and p["epsilon_target"] == target
    assert p["epsilon_spent"] == pytest.approx(ref, rel=1e-9)
    assert 0.99 * target <= p["epsilon_spent"] <= target


def test_ccvr_dp_secagg_hide_counts(tmp_path, capsys):
    out = tmp_path / "r"
    main(["train", "--method", "ccvr", "--dp-eps", "8", "--secagg", "--hide-counts", *FAST,
          "--out", str(out)])
    s = summary(out)
    p = s["privacy"]
    assert_epsilon_is_opacus(p, 8.0)
    assert [r["label"] for r in p["releases"]] == ["ccvr-stats"]
    assert p["covers"] == "calibration uploads only"
    assert p["distributed_noise"] is True and p["hide_counts"] is True
    assert s["accuracy_before_calibration"] == json.loads(
        (out / "metrics.jsonl").read_text().splitlines()[-1])["accuracy"]
    assert "NOT differentially private" in capsys.readouterr().out
    entries = load_transcript(out / "server" / "transcript")
    views = {e["view"] for e in entries if e["label"] == "ccvr-stats"}
    assert "plain-upload" not in views and {"ciphertext", "aggregate"} <= views
    sizes = [e["bytes"] for e in entries if e["view"] == "ciphertext"]
    assert len(sizes) == 4 and len(set(sizes)) == 1  # every client's upload has one size
    assert s["uploaded_bytes"] == s["calibration_upload_bytes"] == sum(sizes)


def test_ccvr_secagg_without_hidden_counts(tmp_path, capsys):
    out = tmp_path / "r"
    main(["train", "--method", "ccvr", "--secagg", *FAST, "--out", str(out)])
    s = summary(out)
    assert not s["skipped_releases"] and not s["rejected_uploads"]
    assert s["accuracy"] != s["accuracy_before_calibration"]
    assert "no differential privacy" in s["privacy"]["statement"]


def test_creff_dp(tmp_path, capsys):
    out = tmp_path / "r"
    main(["train", "--method", "creff", "--dp-eps", "8", "--match-steps", "5",
          "--retrain-steps", "10", *FAST, "--out", str(out)])
    p = summary(out)["privacy"]
    assert_epsilon_is_opacus(p, 8.0)
    assert {r["label"] for r in p["releases"]} == {"creff-grad"}
    assert p["noise_multipliers"]["creff-grad"] == p["releases"][0]["noise_multiplier"]
    entries = load_transcript(out / "server" / "transcript")
    assert {e["view"] for e in entries} >= {"plain-upload", "model-state"}


def test_dp_train_covers_model_updates(tmp_path, capsys):
    out = tmp_path / "r"
    main(["train", "--method", "ccvr", "--dp-eps", "4", "--dp-train", *FAST, "--out", str(out)])
    p = summary(out)["privacy"]
    assert p["covers"] == "calibration uploads and model updates (DP-SGD)"
    assert_epsilon_is_opacus(p, 4.0)
    assert {r["label"] for r in p["releases"]} == {"dp-sgd", "ccvr-stats"}


def test_plain_run_records_plain_uploads(tmp_path, capsys):
    out = tmp_path / "r"
    main(["train", "--method", "ccvr", *FAST, "--out", str(out)])
    entries = load_transcript(out / "server" / "transcript")
    plain = [e for e in entries if e["view"] == "plain-upload" and e["label"] == "ccvr-stats"]
    assert len(plain) == 4 and set(plain[0]["tensors"]) == {"count", "sum", "outer"}
    assert summary(out)["uploaded_bytes"] == sum(e["bytes"] for e in plain)
    updates = [e for e in entries if e["label"] == "model-update"]
    assert summary(out)["model_update_bytes"] == sum(e["bytes"] for e in updates)
    assert "in the clear" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [
    (["--hide-counts"], "hide-counts"),
    (["--method", "ccvr", "--dp-eps", "8", "--hide-counts"], "--secagg"),
    (["--method", "ccvr", "--dp-eps", "8", "--dp-clip", "1e300"], "--dp-clip"),
    (["--method", "creff", "--dp-eps", "8", "--dp-grad-clip", "1e300"], "--dp-grad-clip"),
    (["--method", "ccvr", "--dp-eps", "8", "--dp-delta", "0.5"], "1/N"),
    (["--dp-eps", "8"], "nothing to protect"),
    (["--dp-eps", "8", "--calibrate", "oracle"], "oracle"),
    (["--method", "moon", "--dp-eps", "8", "--dp-train"], "dp-train"),
    (["--method", "creff", "--dp-eps", "0.000001", "--rounds", "50"], "budget"),
])
def test_bad_privacy_settings_one_line(args, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *args, "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code in (2, 3)
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("args,needle", [
    # an epsilon that protects nothing, or none at all
    (["--method", "ccvr", "--dp-eps", "1e300"], "--dp-eps must be in (0, 100]"),
    (["--method", "ccvr", "--dp-eps", "100.5"], "--dp-eps must be in (0, 100]"),
    (["--method", "ccvr", "--dp-eps", "0"], "--dp-eps must be in (0, 100]"),
    (["--method", "ccvr", "--dp-eps", "-1"], "--dp-eps must be in (0, 100]"),
    (["--method", "ccvr", "--dp-eps", "nan"], "--dp-eps must be in (0, 100]"),
    # DP parameters without the budget they belong to would be silently ignored
    (["--method", "ccvr", "--dp-delta", "1e-6"], "--dp-delta belong(s) to a DP budget"),
    (["--method", "ccvr", "--dp-clip", "2"], "--dp-clip belong(s) to a DP budget"),
    (["--method", "creff", "--dp-grad-clip", "2"], "--dp-grad-clip belong(s) to a DP budget"),
    (["--method", "ccvr", "--accountant", "prv"], "--accountant belong(s) to a DP budget"),
    (["--method", "ccvr", "--dp-eps", "8", "--dp-nominal-size", "100"], "belong(s) to DP-SGD"),
    (["--method", "ccvr", "--dp-eps", "8", "--dp-train-share", "0.3"], "belong(s) to DP-SGD"),
    # secure aggregation that protects nothing, or sums too few uploads
    (["--method", "fedavg", "--secagg"], "--secagg-updates"),
    (["--method", "ccvr", "--secagg", "--clients", "1"], "fewer than --secagg-min-clients 2"),
    (["--method", "creff", "--secagg", "--clients", "4", "--participation", "0.25"],
     "fewer than --secagg-min-clients"),
    (["--secagg-updates", "--clients", "4", "--secagg-min-clients", "5"],
     "fewer than --secagg-min-clients 5"),
    (["--method", "ccvr", "--secagg", "--secagg-min-clients", "1"], ">= 2"),
    (["--method", "ccvr", "--secagg-min-clients", "3"], "belongs to secure aggregation"),
])
def test_settings_that_weaken_a_guarantee_are_refused(args, needle, tmp_path, capsys):
    """One line, exit 2, and no run folder written."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", *FAST[:4], *args, "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err
    assert not out.exists()


def test_key_holder_refuses_a_sum_below_its_own_minimum():
    """The key holder decrypts no sum of fewer uploads than its own --secagg-min-clients,
    whatever number the server asks it to decrypt for."""
    import torch

    from privfedcal.errors import UploadRejected
    from privfedcal.privacy.packing import PayloadLayout
    from privfedcal.privacy.secagg import CKKSParams, KeyHolder, ServerAggregator, encrypt_payload
    from privfedcal.privacy.secagg_stage import key_holder_release

    payload = {"sum": torch.ones(4, dtype=torch.float64)}
    layout = PayloadLayout.from_payload(payload, symmetric=frozenset())
    holder = KeyHolder(CKKSParams.for_magnitude(10.0, max_clients=4))
    server = ServerAggregator(holder.public_context_bytes(), layout)
    server.add(encrypt_payload(payload, layout, holder.public_context_bytes()).to_bytes())
    with pytest.raises(UploadRejected, match="below this key holder's minimum of 3"):
        key_holder_release(holder, server.result(), layout, 2, min_clients=3)
    with pytest.raises(UploadRejected, match="minimum of 2"):
        key_holder_release(holder, server.result(), layout, 1, min_clients=2)
