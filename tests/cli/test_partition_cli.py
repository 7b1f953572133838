"""``privfedcal partition`` in-process: output files agree with the library; errors are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from privfedcal.cli.main import main
from privfedcal.data import (
    PartitionSpec,
    class_counts,
    load_dataset,
    longtail_counts,
    partition_indices,
)


def test_partition_writes_table_heatmap_and_json(tmp_path, capsys):
    out = tmp_path / "part"
    main(["partition", "--clients", "4", "--alpha", "0.5", "--seed", "3", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert "total" in stdout and "client" in stdout and "partition.json" in stdout
    assert (out / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "partition.json").read_text())
    data = load_dataset("digits")
    labels = data.y_train.numpy()
    parts = partition_indices(labels, PartitionSpec(num_clients=4, alpha=0.5), 3)
    expected = class_counts(labels, parts, 10)
    assert np.array_equal(np.array(summary["counts"]), expected)  # the same partition as train
    assert summary["sizes"] == expected.sum(axis=1).tolist()
    assert summary["num_assigned"] == summary["num_train"] == data.num_train
    assert (summary["partition"], summary["clients"], summary["seed"]) == ("dirichlet", 4, 3)


def test_longtail_drops_samples(tmp_path, capsys):
    out = tmp_path / "lt"
    main(["partition", "--partition", "longtail", "--imbalance-factor", "10", "--clients", "3",
          "--out", str(out)])
    capsys.readouterr()
    summary = json.loads((out / "partition.json").read_text())
    assert summary["num_assigned"] < summary["num_train"]
    sizes = np.bincount(load_dataset("digits").y_train.numpy())
    assert summary["class_totals"] == longtail_counts(sizes, 10.0).tolist()


@pytest.mark.parametrize("args, message", [
    (["--alpha", "0"], "alpha"),
    (["--partition", "pathological"], "valid choices: iid, dirichlet"),
    (["--dataset", "mnist"], "valid choices: digits"),
    (["--clients", "5000"], "5000 clients"),
    (["--partition", "domains"], "domain folders"),
    (["--dataset", "cifar10"], "--data-root"),
    (["--clients", "many"], "many"),
])
def test_errors_are_one_stderr_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["partition", "--out", str(tmp_path / "o"), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("privfedcal: error:")
    assert message in err and "Traceback" not in err


def test_an_earlier_partition_is_kept_unless_overwrite(tmp_path, capsys):
    from cli_helpers import assert_usage_error

    out = tmp_path / "part"
    main(["partition", "--clients", "3", "--out", str(out)])
    capsys.readouterr()
    before = (out / "partition.json").read_text()
    assert_usage_error(["partition", "--clients", "4", "--out", str(out)], capsys,
                       "already holds a partition", "--overwrite")
    assert (out / "partition.json").read_text() == before
    main(["partition", "--clients", "4", "--out", str(out), "--overwrite"])
    assert json.loads((out / "partition.json").read_text())["clients"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["partition.json", "partition.png"]
