"""Under --hide-counts no client size reaches the server: a size is the total of the
client's hidden class counts, and with its cohort's determined sums it splits them
(``attacks/reconstruction/count_splits.py``). Model updates in the clear are averaged with
uniform public weights; under --secagg-updates the sizes travel inside the encrypted sum."""

from __future__ import annotations

import json

from privfedcal.attacks.reconstruction.disaggregate_attack import (
    NO_SIZES,
    disaggregate_run,
    split_summary,
)
from privfedcal.attacks.reconstruction.runner import load_run
from privfedcal.cli.main import main
from privfedcal.privacy.secagg_updates import SecureUpdates
from privfedcal.privacy.uplink import Uplink

RUN = ["train", "--method", "creff", "--creff-weighting", "sample", "--clients", "4",
       "--participation", "0.5", "--rounds", "3", "--local-epochs", "1", "--match-steps", "2",
       "--retrain-steps", "2", "--dataset", "digits", "--device", "cpu", "--threads", "1",
       "--data-seed", "0", "--secagg", "--hide-counts"]


def test_hidden_counts_weigh_clear_updates_uniformly_and_encrypted_ones_by_size():
    assert Uplink(hide_counts=True).update_weights([3.0, 5.0]) == [1.0, 1.0]
    wire = SecureUpdates(Uplink())
    assert Uplink(hide_counts=True, update_stages=[wire]).update_weights([3.0, 5.0]) == [3.0,
                                                                                      5.0]
    assert Uplink().update_weights([3.0, 5.0]) == [3.0, 5.0]


def test_no_size_reaches_the_server_and_no_cohort_is_split(tmp_path):
    main([*RUN, "--out", str(tmp_path / "run")])
    index = json.loads((tmp_path / "run" / "server" / "transcript" / "index.json").read_text())
    weights = {e["weight"] for e in index if e["label"] == "model-update"}
    assert weights == {1.0}
    sizes = json.loads((tmp_path / "run" / "private" / "partition.json").read_text())["sizes"]
    assert len(set(sizes)) > 1  # the clients' sizes differ: uniform weights are not sizes
    records, notes = disaggregate_run(load_run(tmp_path / "run"))
    assert split_summary(records)["split"] == 0 and NO_SIZES in notes
    summary = json.loads((tmp_path / "run" / "server" / "summary.json").read_text())
    assert "no client size reaches the server" in summary["privacy"]["statement"]
