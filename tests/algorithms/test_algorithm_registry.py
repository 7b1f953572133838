"""Every registered method builds, configures a tiny model and takes finite steps."""

from __future__ import annotations

import pytest
import torch

from privfedcal.algorithms import ALGORITHMS, Algorithm, create_algorithm
from privfedcal.errors import UsageError

EXPECTED = {"fedavg", "fedprox", "fedavgm", "moon", "feduv", "freeze", "clsnorm", "clsprox"}


def test_registry_is_complete() -> None:
    assert set(ALGORITHMS.names()) == EXPECTED


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
        algo.begin_client(model, global_state, client_state)
        x, y = make_batch(5, seed=visit)
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
    for name in EXPECTED:
        assert name in str(err.value)


def test_unknown_hyperparameter() -> None:
    with pytest.raises(UsageError, match="tau"):
        create_algorithm("fedprox", num_classes=3, tau=0.5)
    with pytest.raises(UsageError, match="none"):
        create_algorithm("fedavg", num_classes=3, mu=0.1)
