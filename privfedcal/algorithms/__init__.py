"""Federated methods, found by name: ``create_algorithm("fedprox", num_classes=10, mu=0.01)``.

Importing this package registers every method below.
"""

from privfedcal.algorithms import (  # noqa: F401  (imported to register)
    clsnorm,
    clsprox,
    fedavg,
    fedavgm,
    fedprox,
    feduv,
    freeze,
    moon,
)
from privfedcal.algorithms.base import ALGORITHMS, Algorithm, create_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "create_algorithm"]
