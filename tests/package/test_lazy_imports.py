"""A default digits run loads none of the heavy libraries it does not use (start-up time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: libraries that only some commands need: each loads when a setting asks for it
UNUSED_BY_DEFAULT = ("tenseal", "opacus", "torchvision", "sklearn", "flwr", "matplotlib")

SCRIPT = """
import json, sys
from privfedcal.cli.main import app
try:
    app(["train", "--rounds", "1", "--out", sys.argv[1]], standalone_mode=False)
finally:
    print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_default_train_loads_no_unused_library(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "torch" in loaded  # the probe sees what the run imported
    assert loaded.isdisjoint(UNUSED_BY_DEFAULT), sorted(loaded & set(UNUSED_BY_DEFAULT))
