"""Federated methods, found by name: ``create_algorithm("fedprox", num_classes=10, mu=0.01)``.

The built-in methods are listed in ``ALGORITHMS`` (``algorithm.py``), each imported on its
first lookup; an extension is one file whose class ``@register`` adds.
"""

from privfedcal.algorithms.algorithm import (
    ALGORITHMS,
    Algorithm,
    ClientContext,
    create_algorithm,
    register,
)

__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "create_algorithm", "register"]
