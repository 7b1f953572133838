"""``privfedcal partition`` shares ``train``'s defaults and ``--config`` files."""

from __future__ import annotations

import json

from privfedcal.cli.main import main
from privfedcal.settings.run_config import RunConfig


def test_partition_defaults_are_trains(tmp_path, capsys):
    out = tmp_path / "p"
    main(["partition", "--out", str(out)])
    capsys.readouterr()
    part = json.loads((out / "partition.json").read_text())
    d = RunConfig()
    assert (part["imbalance_factor"], part["clients"], part["alpha"], part["min_size"]) == \
        (d.data.imbalance_factor, d.data.clients, d.data.alpha, d.data.min_size)


def test_partition_reads_the_train_config_and_matches_the_run(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text('clients = 3\nalpha = 0.3\nseed = 5\nrounds = 1\nlocal_epochs = 1\n'
                    'threads = 1\ndevice = "cpu"\ntranscript = false\n')
    main(["partition", "--config", str(conf), "--out", str(tmp_path / "p")])
    main(["train", "--config", str(conf), "--out", str(tmp_path / "run")])
    capsys.readouterr()
    shown = json.loads((tmp_path / "p" / "partition.json").read_text())
    used = json.loads((tmp_path / "run" / "private" / "partition.json").read_text())
    assert shown["counts"] == used["counts"] and shown["seed"] == used["seed"] == 5


def test_partition_of_a_protected_run_needs_its_data_seed(tmp_path, capsys):
    """A protected run draws its partition from a fresh data seed: `partition --config
    RUN/config.json` (the experimenter's config, which records it) shows that partition,
    and the public seed alone does not."""
    run = tmp_path / "run"
    main(["train", "--clients", "3", "--alpha", "0.3", "--rounds", "1", "--local-epochs", "1",
          "--threads", "1", "--device", "cpu", "--method", "ccvr", "--secagg",
          "--no-transcript", "--out", str(run)])
    main(["partition", "--config", str(run / "config.json"), "--out", str(tmp_path / "p")])
    main(["partition", "--config", str(run / "server" / "config.json"),
          "--out", str(tmp_path / "q")])
    capsys.readouterr()
    used = json.loads((run / "private" / "partition.json").read_text())
    shown = json.loads((tmp_path / "p" / "partition.json").read_text())
    public = json.loads((tmp_path / "q" / "partition.json").read_text())
    assert shown["counts"] == used["counts"] and shown["seed"] == used["data_seed"]
    assert public["counts"] != used["counts"]
