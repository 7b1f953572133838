"""Every registered method builds, configures a tiny model and takes finite steps."""

from __future__ import annotations

import pkgutil

import pytest
import torch

import privfedcal.algorithms
from privfedcal.algorithms import ALGORITHMS, Algorithm, create_algorithm
from privfedcal.algorithms.algorithm import client_context
from privfedcal.errors import UsageError

#: the methods of the papers and their baselines; a new method adds itself (one file)
PAPERS = {"fedavg", "fedprox", "fedavgm", "moon", "feduv", "freeze", "clsnorm", "clsprox"}


def test_every_method_module_registers_its_method() -> None:
    """A method is one file in algorithms/: ``ALGORITHMS``' table of built-ins names each
    module's method, and every module but the two base classes (``algorithm``: a method;
    ``vector_loss``: a method's batched loss for ``--client-batch``) and the private helpers
    (``_name``) registers one."""
    bases = {"algorithm", "vector_loss"}
    modules = {m.name for m in pkgutil.iter_modules(privfedcal.algorithms.__path__)
               if m.name not in bases and not m.name.startswith("_")}
    owners = {ALGORITHMS.get(n).__module__.rsplit(".", 1)[1] for n in ALGORITHMS.names()}
    assert owners == modules
    assert PAPERS <= set(ALGORITHMS.names())


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_round_trip(name: str, make_mlp, make_batch) -> None:
    algo = create_algorithm(name, num_classes=3)
    assert isinstance(algo, Algorithm) and algo.name == name
    model = make_mlp(0)
    algo.configure_model(model, torch.Generator().manual_seed(0))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    client_state = None
    for visit in range(2):  # the second visit sees the client state of the first
        model.load_state_dict(global_state)
        x, y = make_batch(5, seed=visit)
        algo.begin_client(model, global_state, client_state, client_context(0, y, 3))
        opt.zero_grad()
        loss = algo.local_loss(model, x, y)
        assert loss.ndim == 0 and torch.isfinite(loss)
        loss.backward()
        opt.step()
        client_state = algo.end_client(model)
    averaged = {k: v.clone() for k, v in model.state_dict().items()}
    new_global, server_state = algo.server_update(global_state, averaged, None)
    assert new_global.keys() == global_state.keys()
    assert all(torch.isfinite(v.float()).all() for v in new_global.values())
    assert server_state is None or all(isinstance(v, torch.Tensor) for v in server_state.values())


def test_unknown_method_lists_names() -> None:
    with pytest.raises(UsageError) as err:
        create_algorithm("scaffold", num_classes=3)
    for name in ALGORITHMS.names():
        assert name in str(err.value)


def test_unknown_hyperparameter() -> None:
    with pytest.raises(UsageError, match="tau"):
        create_algorithm("fedprox", num_classes=3, tau=0.5)
    with pytest.raises(UsageError, match="none"):
        create_algorithm("fedavg", num_classes=3, mu=0.1)
