"""FedAvg (McMahan et al., AISTATS 2017): local cross-entropy SGD, sample-weighted average.

Every hook is the base class default; the class exists so the method is found by name.
"""

from __future__ import annotations

from privfedcal.algorithms.algorithm import Algorithm


class FedAvg(Algorithm):
    """Plain FedAvg: ``L = CE(g(f(x)), y)``; the server keeps the weighted average."""

    name = "fedavg"
    dp_sgd = True
