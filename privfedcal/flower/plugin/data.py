"""A node's data as batches: ``privfedcal.calibration.batches`` (Flower-free, so that
``privfedcal.api.ownloop`` reads DataLoaders the same way in a base install)."""

from privfedcal.calibration.batches import (
    X_KEYS,
    Y_KEYS,
    batches,
    compute,
    num_samples,
    split_batch,
)

__all__ = ["X_KEYS", "Y_KEYS", "batches", "compute", "num_samples", "split_batch"]
