"""A partial attack (attacks/reconstruction/resume.py): keys per job, the partial attack.json and its images
read back as written, and a resume refused when its settings or targets differ."""

from __future__ import annotations

import json

import pytest
import torch

from privfedcal.attacks.reconstruction.resume import (
    PARTIAL_IMAGES,
    finished,
    job_keys,
    read_partial,
    write_partial,
)
from privfedcal.attacks.reconstruction.scoring import Attacked
from privfedcal.errors import UsageError

SETTINGS = {"attack": "stats", "run": "/r", "clients": (0,), "classes": None, "steps": 5}
KEYS = ["a", "b", "c"]


def test_job_keys_number_repeated_descriptions():
    assert job_keys(["x", "y", "x", "x"]) == ["x", "y", "x #2", "x #3"]


def partial(tmp_path):
    done = {2: Attacked({"target": "c", "psnr": float("nan")}, torch.zeros(0, 1, 2, 2),
                        torch.rand(3, 1, 2, 2)),
            0: Attacked({"target": "a", "psnr": 12.5}, torch.rand(1, 1, 2, 2),
                        torch.rand(1, 1, 2, 2))}
    write_partial(tmp_path / "attack.json", tmp_path / PARTIAL_IMAGES, SETTINGS, KEYS, done)
    return done


def test_partial_attack_reads_back_as_written(tmp_path):
    done = partial(tmp_path)
    doc = json.loads((tmp_path / "attack.json").read_text())
    assert doc["partial"] is True and (doc["targets_done"], doc["targets_planned"]) == (2, 3)
    assert doc["done"] == ["a", "c"] and doc["records"][1]["psnr"] is None  # strict JSON
    back = read_partial(tmp_path)
    assert back is not None and back.planned == 3
    got = finished(back, SETTINGS, KEYS)
    assert sorted(got) == [0, 2]
    for i in got:
        torch.testing.assert_close(got[i].recon, done[i].recon, rtol=0, atol=0)
        torch.testing.assert_close(got[i].truth, done[i].truth, rtol=0, atol=0)
    assert got[0].record == {"target": "a", "psnr": 12.5}


def test_a_complete_attack_is_no_partial_one(tmp_path):
    (tmp_path / "attack.json").write_text(json.dumps([{"target": "a"}]))
    assert read_partial(tmp_path) is None
    assert read_partial(tmp_path / "absent") is None


def test_resume_refuses_other_settings_or_targets(tmp_path):
    partial(tmp_path)
    back = read_partial(tmp_path)
    with pytest.raises(UsageError, match="steps differ"):
        finished(back, {**SETTINGS, "steps": 6}, KEYS)
    with pytest.raises(UsageError, match="other targets"):
        finished(back, SETTINGS, ["a", "b", "d"])
    (tmp_path / PARTIAL_IMAGES).unlink()
    with pytest.raises(UsageError, match="missing"):
        read_partial(tmp_path)
