"""How the vectorised trainer finds a method's local loss in its batched form
(``vector_loss_of``): the one its class declares (``Algorithm.vector_loss``;
``algorithms/vector_loss.py``: a functional forward, per-row weights, 1 real and 0
padding, and weighted means), else FedAvg's for a method that keeps FedAvg's client hooks.

With every weight 1 a declared loss is the method's own ``Algorithm.local_loss`` (tested
against it for every registered method).
"""

from __future__ import annotations

from privfedcal.algorithms.algorithm import Algorithm
from privfedcal.algorithms.vector_loss import Forward, VectorLoss, weighted_ce, weighted_mean

#: the client hooks a batched loss stands for; a method keeping Algorithm's trains on FedAvg's
_CLIENT_HOOKS = ("begin_client", "local_loss", "end_client")


def _declared(cls: type[Algorithm]) -> VectorLoss | None:
    """The ``vector_loss`` the class declares, or inherits from a class whose client hooks
    it keeps; None where a class below the declaration redefines a client hook (its loss
    is no longer the declared one)."""
    for klass in cls.__mro__:
        own = vars(klass)
        if own.get("vector_loss") is not None:
            return own["vector_loss"]
        if any(h in own for h in _CLIENT_HOOKS):
            return None
    return None


def vector_loss_of(algo: Algorithm | type[Algorithm]) -> VectorLoss | None:
    """The vectorised form of a method's loss: the one its class declares
    (``vector_loss``), else FedAvg's when the method keeps FedAvg's client hooks (its
    differences are the server rule or the model's configuration); None when it has none
    (it trains only with ``--client-batch 1``)."""
    cls = algo if isinstance(algo, type) else type(algo)
    declared = _declared(cls)
    if declared is not None:
        return declared
    if all(getattr(cls, h) is getattr(Algorithm, h) for h in _CLIENT_HOOKS):
        return VectorLoss()
    return None


__all__ = ["Forward", "VectorLoss", "vector_loss_of", "weighted_ce", "weighted_mean"]
