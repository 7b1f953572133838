"""Federated methods, found by name: ``create_algorithm("fedprox", num_classes=10, mu=0.01)``.

Importing this package imports every module in it, and each registers its method
(``@register``): a new method is one new file here.
"""

import importlib
import pkgutil

from privfedcal.algorithms.algorithm import ALGORITHMS, Algorithm, ClientContext, create_algorithm

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "create_algorithm"]
