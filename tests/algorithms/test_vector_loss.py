"""A method's batched loss is declared on its class, built-in methods and extensions alike,
and a subclass that redefines a client hook does not inherit a form that no longer holds."""

from __future__ import annotations

from privfedcal.algorithms import ALGORITHMS
from privfedcal.algorithms.fedprox import FedProx
from privfedcal.algorithms.vector_loss import VectorLoss
from privfedcal.federation.vector_losses import vector_loss_of


def test_the_built_in_methods_with_a_loss_of_their_own_declare_it():
    declared = {name for name, cls in ALGORITHMS.items() if cls.vector_loss is not None}
    assert {"fedprox", "clsprox", "moon", "feduv"} <= declared
    for name in declared:
        assert vector_loss_of(ALGORITHMS.get(name)) is ALGORITHMS.get(name).vector_loss
    assert ALGORITHMS.get("clsprox").vector_loss is not FedProx.vector_loss  # its own anchor


def test_a_subclass_keeps_the_form_only_while_it_keeps_the_hooks():
    class Scaled(FedProx):
        name = "scaled-prox"

        def local_loss(self, model, x, y):
            return 2 * super().local_loss(model, x, y)

    class Renamed(FedProx):
        name = "renamed-prox"

    assert vector_loss_of(Renamed) is FedProx.vector_loss
    assert vector_loss_of(Scaled) is None
    assert type(vector_loss_of(ALGORITHMS.get("fedavgm"))) is VectorLoss
