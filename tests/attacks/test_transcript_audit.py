"""The epsilon of what a run's server holds, from its server folder alone."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import save_file

from privfedcal.attacks.transcript_audit import run_epsilon
from privfedcal.errors import UsageError
from privfedcal.experiment import build_simulator
from privfedcal.federation.runfolder import server_dir, transcript_dir
from privfedcal.privacy.transcript_files import read_entry


def test_the_server_folder_gives_the_runs_epsilon_and_catches_a_redrawn_release(
        tiny_cfg, tmp_path):
    run = tmp_path / "run"
    summary = build_simulator(tiny_cfg(method="ccvr", dp_eps=8.0, transcript=True),
                              run).run()
    view = tmp_path / "view"  # a copy of the server's folder: all an auditor holds
    shutil.copytree(server_dir(run), view)
    held = run_epsilon(view)
    assert held["epsilon"] == pytest.approx(summary["privacy"]["epsilon_spent"])
    assert held == {k: v for k, v in summary["privacy"]["from_transcript"].items()
                    if k != "epsilon_claimed"}
    # the server holding client 2's statistics twice with two noise draws: worth more
    tr = view / "transcript"
    index = json.loads((tr / "index.json").read_text())
    first = next(e for e in index if e["label"] == "ccvr-stats" and e["client"] == 2)
    again = {k: v + 1.0 for k, v in read_entry(tr, first).items()}
    save_file(again, str(tr / "redrawn.safetensors"))  # a file of its own: no key in it
    redrawn_entry = {k: v for k, v in first.items() if k != "key"}
    (tr / "index.json").write_text(json.dumps(
        [*index, {**redrawn_entry, "attempt": 1, "file": "redrawn.safetensors"}]))
    redrawn = run_epsilon(view)
    assert redrawn["epsilon"] > summary["privacy"]["epsilon_spent"]
    assert redrawn["per_client"]["0"] == held["per_client"]["0"]


def test_a_run_without_dp_has_no_epsilon_and_one_without_transcript_is_refused(
        tiny_cfg, tmp_path):
    build_simulator(tiny_cfg(method="ccvr", transcript=True), tmp_path / "plain").run()
    assert run_epsilon(tmp_path / "plain") is None
    build_simulator(tiny_cfg(method="ccvr", dp_eps=8.0), tmp_path / "hidden").run()
    assert not transcript_dir(tmp_path / "hidden").exists()
    with pytest.raises(UsageError, match="no transcript"):
        run_epsilon(tmp_path / "hidden")
