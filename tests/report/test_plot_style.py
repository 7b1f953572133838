"""The shared plot style and the readability fixes: whole-number round ticks, a CKA scale
that starts at the data, series that differ in more than colour, partition ticks that never
crowd, and plot functions that write PNGs for every input shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from privfedcal.analysis.analysis_plots import _cka_floor, plot_cka
from privfedcal.data.partition_plots import _ticks, plot_partition
from privfedcal.report.run_plots import _round_axis, plot_accuracy, plot_curves, plot_per_class
from privfedcal.report.style.plotstyle import PALETTE, new_figure, series_style, styled

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_round_ticks_are_whole_numbers():
    with styled():
        fig = new_figure(4, 3)
        ax = fig.add_subplot()
        ax.plot([1, 2, 3], [0.1, 0.2, 0.3])  # matplotlib's default ticks here: 1.0, 1.25, ...
        _round_axis(ax)
        fig.canvas.draw()
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks == [1, 2, 3]


def test_cka_scale_starts_at_the_data():
    # hand-computed: floor(0.963 * 20) / 20 = 19 / 20 = 0.95
    assert _cka_floor(np.array([[0.997, 0.963]])) == pytest.approx(0.95)
    assert _cka_floor(np.array([[0.31, 0.9]])) == pytest.approx(0.30)
    assert _cka_floor(np.array([[np.nan]])) == 0.0
    assert _cka_floor(np.array([[1.0, 1.0]])) == pytest.approx(0.95)  # never an empty scale


def test_series_differ_beyond_colour():
    a, b = series_style(0), series_style(1)
    assert a["color"] != b["color"] and a["linestyle"] != b["linestyle"]
    assert a["marker"] != b["marker"] and b["markerfacecolor"] == "none"
    assert b["zorder"] > a["zorder"]  # the later series is drawn on top
    # Okabe-Ito, in a fixed order
    assert PALETTE[:3] == ("#0072B2", "#E69F00", "#009E73")


def test_partition_ticks_do_not_crowd():
    assert _ticks(10) == list(range(10))
    assert _ticks(100) == list(range(0, 100, 10))
    assert _ticks(400)[:3] == [0, 20, 40]


def test_plots_write_pngs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"round": r, "accuracy": 0.1 * r}) + "\n"
                               for r in (1, 2, 3)))
    outs = [
        plot_accuracy(metrics, tmp_path / "a.png", {"method": "m", "dataset": "d",
                                                    "accuracy": 0.5,
                                                    "accuracy_before_calibration": 0.3}),
        plot_accuracy(tmp_path / "missing.jsonl", tmp_path / "empty.png"),
        plot_per_class([0.5, None, 1.0], tmp_path / "pc.png", before=[0.4, None, 0.9]),
        plot_per_class(list(np.linspace(0, 1, 100)), tmp_path / "pc100.png"),
        plot_curves({"a": [(1, 0.1), (2, 0.2)], "b": []}, tmp_path / "c.png"),
        plot_cka({"conv": 0.99, "fc": 0.97}, tmp_path / "cka.png"),
        plot_partition(np.arange(2000).reshape(20, 100) % 7, tmp_path / "p.png"),
    ]
    for out in outs:
        assert out.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(("calibration", "label"), [(None, "global model"),
                                                    ({"name": "creff"}, "creff's re-trained head")])
def test_accuracy_curve_names_what_the_rounds_evaluated(tmp_path, monkeypatch, calibration, label):
    import privfedcal.report.run_plots as plots

    rows = [{"round": r, "accuracy": 0.1 * r, **({"calibration": calibration} if calibration
                                                 else {})} for r in (1, 2)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {}
    monkeypatch.setattr(plots, "save", lambda fig, out: seen.setdefault("fig", fig) and out)
    plots.plot_accuracy(metrics, tmp_path / "a.png")
    assert [t.get_text() for t in seen["fig"].axes[0].get_legend().get_texts()] == [label]


def test_point_labels_do_not_overlap():
    """Crowded points (the audit's settings at equal coordinates, the failure seen on the
    audit plot): every label box is clear of every other; the naive fixed offset overlaps."""
    from privfedcal.report.style.plotstyle import label_points, new_figure, styled

    pts = [(1.0, 87.0, "ccvr eps=inf"), (1.0, 86.8, "ccvr eps=inf sa"),
           (1.0, 80.0, "ccvr eps=8 sa"), (0.99, 40.0, "creff eps=inf"),
           (1.0, 36.5, "creff eps=inf sa"), (1.0, 34.0, "ccvr eps=1 sa")]
    with styled():
        fig = new_figure(5, 4)
        ax = fig.subplots()
        ax.scatter([p[0] for p in pts], [p[1] for p in pts])
        ax.set_xlim(0.5, 1.1)
        label_points(ax, pts)
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert len(boxes) == len(pts)
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        # the old placement (every label 3 points up and right) overlapped here
        naive = [ax.annotate(t, (x, y), xytext=(3, 3), textcoords="offset points",
                             fontsize=6).get_window_extent(renderer) for x, y, t in pts[:2]]
        assert naive[0].overlaps(naive[1])
