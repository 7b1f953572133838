"""accuracy.png drawn without matplotlib: the line, the calibrated marker, empty metrics."""

from __future__ import annotations

import json

from PIL import Image

from privfedcal.report.accuracy_png import _BLUE, _RED, _ticks, plot_accuracy_png


def _colours(path) -> set:
    return {c for _, c in Image.open(path).convert("RGB").getcolors(1 << 20)}


def test_line_and_calibrated_marker(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"round": r, "accuracy": 0.5 + 0.02 * r}) + "\n"
                               for r in range(1, 11)))
    plain = plot_accuracy_png(metrics, tmp_path / "a.png", {"method": "m", "dataset": "d",
                                                            "accuracy": 0.7})
    calibrated = plot_accuracy_png(metrics, tmp_path / "b.png", {
        "method": "m", "dataset": "d", "accuracy": 0.9, "accuracy_before_calibration": 0.7,
        "calibrator": "ccvr"})
    assert Image.open(plain).size == (720, 432)
    assert _BLUE in _colours(plain) and _RED not in _colours(plain)
    assert _RED in _colours(calibrated)


def test_empty_metrics_still_write_a_png(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    assert Image.open(plot_accuracy_png(metrics, tmp_path / "e.png")).format == "PNG"


def test_ticks_are_round_and_cover_the_range() -> None:
    assert _ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    # span 7.6 over 6 ticks: raw step 1.27, the next of 1, 2, 5 x 10^k is 2
    assert _ticks(51.3, 58.9) == [52, 54, 56, 58]
