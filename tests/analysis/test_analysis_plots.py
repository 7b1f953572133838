"""Every plot writes a non-empty PNG and refuses malformed input."""

from pathlib import Path

import numpy as np
import pytest
import torch

from privfedcal.analysis import cka_matrix
from privfedcal.analysis.analysis_plots import plot_cka, plot_classifier_norms, plot_singular_values
from privfedcal.errors import UsageError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_classifier_norms_plot(tmp_path: Path) -> None:
    out = plot_classifier_norms(
        torch.rand(10),
        [0.5] * 10,
        tmp_path / "sub" / "norms.png",
        class_names=[f"c{i}" for i in range(10)],
    )
    assert out == tmp_path / "sub" / "norms.png"
    assert_png(out)
    with pytest.raises(UsageError):
        plot_classifier_norms(torch.rand(3), torch.rand(4), tmp_path / "x.png")
    with pytest.raises(UsageError):
        plot_classifier_norms(torch.rand(3), torch.rand(3), tmp_path / "x.png", class_names=["a"])


@pytest.mark.parametrize(
    "data",
    [
        torch.tensor([[1.0, 0.4, float("nan")], [0.4, 1.0, 0.2], [float("nan"), 0.2, 1.0]]),
        np.eye(2),
        {"conv1": 0.9, "fc1": 0.7, "classifier": 0.3},
        {"iid": {"conv1": 0.95, "fc": 0.9}, "non-iid": {"conv1": 0.9, "fc": 0.4}},
        cka_matrix([{"z": torch.eye(4)}, {"z": torch.rand(4, 3)}]),
    ],
)
def test_cka_plot_inputs(tmp_path: Path, data) -> None:
    assert_png(plot_cka(data, str(tmp_path / "cka.png")))


@pytest.mark.parametrize("bad", [torch.ones(2, 3), {}, {"a": {"x": 1.0}, "b": {"y": 1.0}}, [1, 2]])
def test_cka_plot_rejects(tmp_path: Path, bad) -> None:
    with pytest.raises(UsageError):
        plot_cka(bad, tmp_path / "cka.png")


def test_singular_values_plot(tmp_path: Path) -> None:
    svals = {"iid": torch.linspace(3, 1, 10), "non-iid": np.linspace(2, 0.1, 10)}
    assert_png(plot_singular_values(svals, tmp_path / "sv.png"))
    assert_png(plot_singular_values(svals, tmp_path / "sv_log.png", log_y=True))
    with pytest.raises(UsageError):
        plot_singular_values({}, tmp_path / "sv.png")
