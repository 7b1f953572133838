"""The server's view is a boundary (docs/threat-model.md, "Server"): every attack runs on a
copy of ``RUN/server/`` alone, and under ``--secagg --hide-counts`` nothing in it
determines a client's class counts (the partition comes from a data seed the server does
not hold)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from privfedcal.cli.main import main
from privfedcal.data.datasets import load_dataset
from privfedcal.data.partition import PartitionSpec, class_counts, partition_indices
from privfedcal.settings.run_config import RunConfig, read_run_config

FAST = ["--clients", "3", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--dataset", "digits"]
ATTACK = ["--steps", "2", "--restarts", "1", "--threads", "1"]
PROTECTED = ["--method", "ccvr", "--dp-eps", "8", "--secagg", "--hide-counts"]
CREFF = ["--method", "creff", "--match-steps", "5", "--retrain-steps", "5"]


def server_copy(run: Path, dest: Path) -> Path:
    """Only what the server holds: ``RUN/server/``, nothing of the clients or the
    experimenter (the original run folder is removed, so nothing can fall back on it)."""
    shutil.copytree(run / "server", dest)
    shutil.rmtree(run)
    return dest


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-view")
    main(["train", *FAST, *PROTECTED, "--out", str(root / "run-ccvr")])
    main(["train", *FAST, *CREFF, "--out", str(root / "run-creff")])
    return {name: server_copy(root / f"run-{name}", root / name) for name in ("ccvr", "creff")}


@pytest.mark.parametrize(("name", "attack"), [
    ("ccvr", ["invert", "--stats"]), ("ccvr", ["invert", "--updates"]), ("ccvr", ["classes"]),
    ("creff", ["invert", "--gradients"]), ("creff", ["invert", "--gradients", "--updates"]),
    ("creff", ["invert", "--updates"]), ("creff", ["classes"]), ("ccvr", ["disaggregate"])])
def test_every_attack_runs_on_the_server_view_alone(views, name, attack, tmp_path):
    view = views[name]
    assert sorted(p.name for p in view.iterdir()) == ["config.json", "summary.json",
                                                      "transcript"]
    extra = ATTACK if attack[0] == "invert" else ["--threads", "1"]
    main(["attack", *attack, "--run", str(view), *extra, "--out", str(tmp_path / "out")])
    records = json.loads((tmp_path / "out" / "attack.json").read_text())
    assert records  # something of what the server saw was attacked
    assert all(r.get("scored") is False for r in records)  # and nothing could be scored


def test_the_server_view_has_no_training_data(views):
    from privfedcal.attacks.view import load_run

    view = load_run(views["ccvr"])
    assert view.truth_exp is None and view.exp.parts is None and view.exp.counts is None
    assert view.exp.data.x_train.numel() == 0 and view.cfg.training.data_seed is None


def _counts(cfg: RunConfig, data_seed: int) -> np.ndarray:
    data = load_dataset(cfg.data.dataset)
    labels = data.y_train.numpy()
    spec = PartitionSpec(scheme=cfg.data.partition, num_clients=cfg.data.clients, alpha=cfg.data.alpha,
                         imbalance_factor=cfg.data.imbalance_factor,
                         shards_per_client=cfg.data.shards_per_client, min_size=cfg.data.min_size)
    return class_counts(labels, partition_indices(labels, spec, data_seed), data.num_classes)


def test_hidden_counts_are_not_determined_by_the_server_view(tmp_path):
    """Two runs with the same protocol seed and no --data-seed: the server's config is the
    same, the clients' class counts are not (the data seed is fresh OS entropy, kept on the
    experimenter's side); the public seed does not redraw them; and no file of the server's
    view holds a client's counts (per-client entries are model updates and equal-size
    ciphertexts; the only counts are the federation's aggregate)."""
    args = [*FAST, "--method", "ccvr", "--secagg", "--hide-counts", "--seed", "3"]
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        main(["train", *args, "--out", str(run)])
    public = [json.loads((r / "server" / "config.json").read_text()) for r in runs]
    assert public[0]["data_seed"] is None
    assert {**public[0], "out": None} == {**public[1], "out": None}
    counts = [np.asarray(json.loads((r / "private" / "partition.json").read_text())["counts"])
              for r in runs]
    assert not np.array_equal(counts[0], counts[1])
    for run, held in zip(runs, counts, strict=True):
        cfg = read_run_config(run / "server")
        assert not np.array_equal(_counts(cfg, cfg.training.seed), held)  # the seed does not redraw it
        assert read_run_config(run).training.data_seed not in (None, cfg.training.seed)
        texts = [p.read_text() for p in (run / "server").rglob("*.json")]
        assert not any(str(read_run_config(run).training.data_seed) in t for t in texts)
        for row in held:
            assert not any(json.dumps(row.tolist()) in t for t in texts)
        index = json.loads((run / "server" / "transcript" / "index.json").read_text())
        mine = [e for e in index if e["client"] is not None]
        assert {(e["label"], e["view"]) for e in mine} == {
            ("model-update", "plain-upload"), ("ccvr-stats", "ciphertext")}
        assert len({e["bytes"] for e in mine if e["view"] == "ciphertext"}) == 1


def least_squares(run: Path, key: str = "count") -> tuple[np.ndarray, np.ndarray]:
    """What plain least squares over every round recovers of each client's ``key`` (hidden
    class counts, or the update weight n_k) from ``RUN/server/`` alone (each aggregate's
    contributors are its ciphertext entries), with the public total (the class totals, N)
    as one more equation: (estimate per client, whether each client's value is determined,
    i.e. its unit vector is in the row space)."""
    from privfedcal.privacy.transcript_files import read_entry

    server = run / "server"
    index = json.loads((server / "transcript" / "index.json").read_text())
    clients = json.loads((server / "config.json").read_text())["clients"]
    rows, sums, senders = [], [], {}
    for e in index:
        k = (e["round"], e["label"])
        if e["view"] == "ciphertext":
            senders.setdefault(k, set()).add(e["client"])
        elif e["view"] == "aggregate" and key in (tensors := read_entry(
                server / "transcript", e)):
            rows.append([float(c in senders[k]) for c in range(clients)])
            sums.append(tensors[key].double().numpy())
    partition = json.loads((run / "private" / "partition.json").read_text())
    total = partition["class_totals"] if key == "count" else [partition["num_assigned"]]
    a = np.vstack([np.asarray(rows), np.ones(clients)])
    b = np.vstack([np.asarray(sums), np.asarray(total, dtype=float)])  # public totals
    estimate = np.linalg.lstsq(a, b, rcond=None)[0]
    proj = np.linalg.pinv(a) @ a  # projector onto the row space
    return estimate, np.isclose(np.diag(proj), 1.0, atol=1e-9)


def _truth(run: Path, key: str) -> np.ndarray:
    partition = json.loads((run / "private" / "partition.json").read_text())
    values = partition["counts"] if key == "count" else [[n] for n in partition["sizes"]]
    return np.asarray(values, dtype=float)


@pytest.mark.parametrize(("key", "flags"), [
    ("count", [*CREFF, "--secagg", "--hide-counts", "--creff-weighting", "sample"]),
    ("__weight", ["--method", "fedavg", "--secagg-updates"])], ids=["counts", "sizes"])
def test_secure_sums_survive_differencing_across_rounds(tmp_path, monkeypatch, key, flags):
    """6 rounds at participation 0.5: every round's aggregate holds the hidden class counts
    (CReFF) or the update weights n_k (--secagg-updates) summed over that round's
    contributors. With fixed cohorts (privfedcal/privacy/cohorts.py) least squares over all the
    rounds determines no client's value; with the cohorts switched off (a plain draw of 2 of
    4 clients, the planner's check disabled too) the check before each decryption withholds
    every sum that would single a client out, and with that check off as well the same
    least squares recovers every client exactly."""
    args = [*FAST, "--clients", "4", "--participation", "0.5", "--rounds", "6", *flags,
            "--data-seed", "1"]
    main(["train", *args, "--out", str(tmp_path / "cohorts")])
    summary = json.loads((tmp_path / "cohorts" / "server" / "summary.json").read_text())
    assert summary["privacy"]["whole_run"]["holds"] is True
    estimate, determined = least_squares(tmp_path / "cohorts", key)
    truth = _truth(tmp_path / "cohorts", key)
    assert not determined.any()
    assert all(np.abs(estimate[c] - truth[c]).max() > 1.0 for c in range(4))

    import privfedcal.privacy.cohorts
    import privfedcal.privacy.planner
    from privfedcal.privacy.secagg_stage import WITHHELD, EncryptStage

    monkeypatch.setattr(privfedcal.privacy.cohorts, "secure_rounds", lambda cfg: False)
    monkeypatch.setattr(privfedcal.privacy.planner, "check_secure_aggregation", lambda *a: None)
    main(["train", *args, "--out", str(tmp_path / "held")])
    summary = json.loads((tmp_path / "held" / "server" / "summary.json").read_text())
    # the check before each decryption withholds the sums that would isolate a client
    assert summary["privacy"]["whole_run"]["holds"] is True
    assert any(WITHHELD in s["reason"] for s in summary["skipped_releases"])
    assert not least_squares(tmp_path / "held", key)[1].any()
    monkeypatch.setattr(EncryptStage, "check_whole_run", lambda *a: None)  # that check off
    main(["train", *args, "--out", str(tmp_path / "plain")])
    summary = json.loads((tmp_path / "plain" / "server" / "summary.json").read_text())
    assert summary["privacy"]["whole_run"]["holds"] is False  # the run's own record sees it
    estimate, determined = least_squares(tmp_path / "plain", key)
    truth = _truth(tmp_path / "plain", key)
    assert determined.all()
    assert np.abs(estimate - truth).max() < 0.05


def test_a_plain_run_is_reproducible_and_its_partition_public(tmp_path):
    """Without a protection the partition follows --seed (documented as public): two
    default runs give the same numbers; --data-seed fixes a protected run's partition, and
    ``--config RUN/config.json`` redraws the partition of the run it names."""
    for name in ("a", "b"):
        main(["train", *FAST, "--out", str(tmp_path / name)])
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in "ab"]
    assert summaries[0]["accuracy"] == summaries[1]["accuracy"]
    part = json.loads((tmp_path / "a" / "private" / "partition.json").read_text())
    assert part["data_seed"] == part["seed"] == 0
    main(["train", *FAST, "--secagg", "--method", "ccvr", "--data-seed", "11",
          "--out", str(tmp_path / "c")])
    main(["train", "--config", str(tmp_path / "c" / "config.json"), "--out",
          str(tmp_path / "d")])
    parts = [json.loads((tmp_path / n / "private" / "partition.json").read_text())
             for n in "cd"]
    assert parts[0]["data_seed"] == parts[1]["data_seed"] == 11
    assert parts[0]["counts"] == parts[1]["counts"]
