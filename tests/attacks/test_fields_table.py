"""The table of client fields with the calibrators' releases filled in (attacks/fields_table.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from privfedcal.attacks.fields_table import client_fields, declared, markdown_table
from privfedcal.attacks.reconstruction.class_inference import key_tests
from privfedcal.attacks.release_attacks import declared_releases


def test_every_declared_release_is_tabled_and_read_by_attack_classes():
    """Every calibrator's release has its keys in the table, and ``attack classes`` (the
    class-set inference over every declared release) reads every one of them, as the
    table's budget column says."""
    releases = declared_releases()
    assert {r.label for r in releases} >= {"ccvr-stats", "creff-grad"}
    for r in releases:
        for k in r.keys:
            f = declared("query.payload", "payload", k)
            assert f is not None and r.label in f.holds and r.label in f.flag, (r.label, k)
            assert k in key_tests(r), k  # class inference reads it from the declaration


def test_the_generator_prints_the_table_the_doc_holds():
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-m", "privfedcal.attacks.fields_table"], cwd=root,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == markdown_table()
    assert out.stderr == ""
    assert markdown_table() in (root / "docs" / "threat-model.md").read_text()
    assert len(markdown_table().splitlines()) == len(client_fields()) + 2
