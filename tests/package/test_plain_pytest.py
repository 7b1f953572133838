"""Plain ``pytest`` (the console script, which puts no directory on ``sys.path``) collects
the suite as ``python -m pytest`` does: ``pythonpath`` in pyproject's pytest section."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the console script's own code; ``-P`` keeps the working directory off ``sys.path``
CONSOLE = "import sys, pytest; sys.exit(pytest.console_main())"


def test_plain_pytest_collects_the_extension_toys():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-P", "-c", CONSOLE, "--collect-only", "-q",
                           "-p", "no:cacheprovider", "tests/extensions"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_toy_stage.py::" in done.stdout
