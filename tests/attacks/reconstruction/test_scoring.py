"""attacks/reconstruction/scoring.py: matching rules, strict-JSON records, worst case and summary rows
(``score`` itself runs on real runs in test_runner.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from privfedcal.attacks.reconstruction.scoring import (
    _assign,
    matching_rule,
    records_table,
    summarise,
    worst_case,
    write_records,
)


def test_matching_rule():
    assert matching_rule(5, 5, paired=True) == "paired"
    assert matching_rule(1, 40, paired=False) == "best"      # one image stands for a set
    assert matching_rule(10, 4, paired=False) == "best"      # more images than individuals
    assert matching_rule(4, 10, paired=False) == "hungarian"
    assert matching_rule(4, 4, paired=False) == "hungarian"


def test_assign_by_rule_on_known_images():
    truth = torch.stack([torch.full((1, 2, 2), v) for v in (0.0, 0.5, 1.0)])
    images = torch.stack([torch.full((1, 2, 2), v) for v in (0.9, 0.1)])
    assert _assign(images, truth, "paired").tolist() == [0, 1]
    assert _assign(images, truth, "best").tolist() == [2, 0]
    assert _assign(images, truth, "hungarian").tolist() == [2, 0]
    # two images nearest the same true one: best shares it, hungarian does not
    close = torch.stack([torch.full((1, 2, 2), v) for v in (0.95, 0.9)])
    assert _assign(close, truth, "best").tolist() == [2, 2]
    assert _assign(close, truth, "hungarian").tolist() == [2, 1]


def test_records_are_strict_json_with_non_finite_as_null(tmp_path):
    path = write_records([{"psnr": math.nan, "x": [1.5, math.inf], "n": {"a": -math.inf}}],
                         tmp_path / "sub" / "attack.json")
    assert json.loads(path.read_text()) == [{"psnr": None, "x": [1.5, None], "n": {"a": None}}]


def _rec(target, view, psnr_best, *, client=0, cls=1, n=4, psnr=10.0, prior=8.0, conv=True):
    return {"target": target, "view": view, "client": client, "class": cls, "n": n,
            "psnr": psnr, "psnr_best": psnr_best, "nearest_of_best": psnr_best > 20,
            "prior_psnr": prior, "prior_psnr_best": prior + 1, "ssim": 0.5,
            "feature_cosine": 0.9, "nearest_is_true": 0.25, "converged": conv}


RECORDS = [
    _rec("class-gradient", "aggregate", 18.0, client=None, cls=3, n=7, psnr=12.0),
    _rec("class-stats", "plain-upload", 25.0, client=2, cls=0, n=5, psnr=14.0, prior=9.0),
    _rec("class-stats", "plain-upload", math.nan, client=1, cls=4, n=3, psnr=math.nan,
         conv=False),
    _rec("raw-feature", "hypothetical", 30.0, n=1, psnr=30.0),
]


def test_worst_case_is_the_best_reconstruction():
    assert worst_case(RECORDS) == {"psnr_max": 30.0, "nearest_of_worst": True,
                                   "worst_client": 0, "worst_class": 1,
                                   "worst_target": "raw-feature", "prior_psnr_max": 10.0}
    empty = worst_case([RECORDS[2]])
    assert math.isnan(empty["psnr_max"]) and empty["worst_target"] is None


def test_summary_rows_follow_the_target_order_and_average_finite_values():
    rows = summarise(RECORDS)
    assert [(r["target"], r["view"]) for r in rows] == [
        ("raw-feature", "hypothetical"), ("class-stats", "plain-upload"),
        ("class-gradient", "aggregate")]
    stats = rows[1]
    assert stats["targets"] == 2 and stats["n"] == "3-5" and stats["converged"] == 1
    assert stats["psnr_max"] == 25.0 and stats["worst_client"] == 2
    assert stats["psnr"] == 14.0            # the NaN record is left out of the mean
    assert stats["prior_psnr"] == pytest.approx(8.5)
    assert rows[0]["n"] == "1"
    table = records_table(RECORDS, "t")
    assert [c.header for c in table.columns][:5] == ["target", "view", "#", "n", "max PSNR"]
    assert table.row_count == 3
    assert list(table.columns[4].cells) == ["30.00", "25.00", "18.00"]
    assert list(table.columns[6].cells) == ["k0/c1", "k2/c0", "kall/c3"]
