"""Datasets as tensors, client partitions and batched augmentation."""

from privfedcal.data.augment import augment_batch
from privfedcal.data.datasets import DATASETS, Dataset, default_model_for, load_dataset
from privfedcal.data.partition import (
    PARTITIONS,
    PartitionSpec,
    class_counts,
    longtail_counts,
    longtail_subset,
    partition_indices,
)

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "Dataset",
    "PartitionSpec",
    "augment_batch",
    "class_counts",
    "default_model_for",
    "load_dataset",
    "longtail_counts",
    "longtail_subset",
    "partition_indices",
]
