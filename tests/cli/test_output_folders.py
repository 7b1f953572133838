"""Output folders (``privfedcal/report/output_folder.py``): an ``--out`` the system refuses is a
usage error (one line, exit 2) before any work, whatever the permission bits say."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_usage_error

from privfedcal.errors import UsageError
from privfedcal.report.output_folder import check_writable

FAST = ["--clients", "4", "--rounds", "1", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--no-transcript"]
#: pseudo file systems that refuse new entries even to root (whose permission bits pass)
PSEUDO = [p for p in (Path("/proc"), Path("/sys")) if p.is_dir()]


@pytest.mark.parametrize("root", PSEUDO, ids=str)
def test_pseudo_file_system_is_refused(root):
    with pytest.raises(UsageError, match="cannot write to --out"):
        check_writable(root / "privfedcal-out")
    with pytest.raises(UsageError, match="cannot write to --out"):
        check_writable(root)


@pytest.mark.parametrize("root", PSEUDO, ids=str)
def test_train_and_partition_under_pseudo_file_system_exit_2(root, capsys):
    assert_usage_error(["train", *FAST, "--out", str(root / "privfedcal-run")], capsys,
                       "cannot write to --out", str(root))
    assert_usage_error(["partition", "--clients", "4", "--out", str(root / "privfedcal-part")],
                       capsys, "cannot write to --out")


def test_probe_leaves_nothing_behind(tmp_path):
    check_writable(tmp_path / "a" / "b")
    check_writable(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("root", PSEUDO, ids=str)
def test_audit_dp_out_under_pseudo_file_system_exit_2(root, capsys, monkeypatch):
    """``audit dp`` checks its --out before any game runs (it used to fail with exit 1)."""
    import privfedcal.attacks.distinguishing.channels

    def never(*_a, **_k):
        raise AssertionError("the audit started")

    monkeypatch.setattr(privfedcal.attacks.distinguishing.channels, "build_channels", never)
    assert_usage_error(["audit", "dp", "--method", "ccvr", "--dp-eps", "4", "--threads", "1",
                        "--out", str(root / "privfedcal-audit")], capsys, "cannot write to --out")
