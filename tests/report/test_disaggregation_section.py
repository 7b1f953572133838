"""The run report shows ``attack disaggregate``'s folder: its table (one row per release and
payload key) and its verdict, beside the other attacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from privfedcal.report.run_report import build_run_report


def test_the_run_report_shows_the_disaggregation(run_dir: Path, tmp_path: Path):
    full = tmp_path / "disaggregated"
    shutil.copytree(run_dir, full)
    assert 'id="disaggregation"' not in build_run_report(full).read_text()
    folder = full / "attack-disaggregate"
    folder.mkdir()
    base = {"target": "disaggregate", "label": "model-update", "key": "__weight",
            "kind": "constant", "releases": 3, "rounds": [1, 2, 3],
            "participants": [[0, 1], [2, 3], [0, 1]], "public_total": "N=1346",
            "finest_group": 2, "fit_residual": 1e-6, "scored": True, "exact": False,
            "determined": False, "max_abs_error": 80.0}
    (folder / "attack.json").write_text(json.dumps(
        [{**base, "client": c, "group": [0, 1] if c < 2 else [2, 3], "rel_error": e}
         for c, e in enumerate((0.25, 0.5, 0.75, 0.125))]))
    page = build_run_report(full).read_text()
    assert 'id="disaggregation"' in page and "model-update" in page
    assert "nothing finer than a group of 2 clients is determined (of 4)" in page
    assert "0.406" in page and "k3" in page  # mean relative error, worst-off client
