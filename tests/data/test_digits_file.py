"""The digits arrays shipped with the package are scikit-learn's, pixel for pixel."""

from __future__ import annotations

import numpy as np
import pytest

from privfedcal.data.datasets import _digits_arrays


def test_shipped_digits_equal_scikit_learn() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    bunch = datasets.load_digits()
    images, labels = _digits_arrays()
    assert images.dtype == np.uint8 and labels.dtype == np.uint8
    np.testing.assert_array_equal(images.astype(np.float64), bunch.images)
    np.testing.assert_array_equal(labels.astype(np.int64), bunch.target)
