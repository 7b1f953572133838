"""FedAvgM: beta = 0, server_lr = 1 is FedAvg; two rounds with momentum by hand."""

from __future__ import annotations

import pytest
import torch

from privfedcal.algorithms import create_algorithm
from privfedcal.algorithms.fedavgm import MOMENTUM_PREFIX
from privfedcal.errors import UsageError


def _state(w: float, mean: float, count: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.tensor([w, 2 * w]),
        "bn.running_mean": torch.tensor([mean]),
        "bn.num_batches_tracked": torch.tensor(count),
    }


def test_no_momentum_is_fedavg(mlp) -> None:
    algo = create_algorithm("fedavgm", num_classes=3, beta=0.0, server_lr=1.0)
    glob = mlp.state_dict()
    avg = {k: v + 0.25 for k, v in glob.items()}
    new, _ = algo.server_update(glob, avg, None)
    assert new.keys() == avg.keys()
    for key in avg:
        torch.testing.assert_close(new[key], avg[key])
    new, _ = algo.server_update(_state(1.0, 3.0, 5), _state(0.8, 7.0, 9), None)
    torch.testing.assert_close(new["w"], torch.tensor([0.8, 1.6]))


def test_two_rounds_by_hand() -> None:
    algo = create_algorithm("fedavgm", num_classes=3, beta=0.5, server_lr=0.5)
    # round 1: g0 = 1.0, avg = 0.8 -> delta 0.2, v1 = 0.2, g1 = 1.0 - 0.5*0.2 = 0.9
    g1, s1 = algo.server_update(_state(1.0, 0.0, 1), _state(0.8, 4.0, 7), None)
    torch.testing.assert_close(g1["w"], torch.tensor([0.9, 1.8]))
    torch.testing.assert_close(s1[MOMENTUM_PREFIX + "w"], torch.tensor([0.2, 0.4]))
    # BN statistics and integer buffers come from the average, with no momentum
    assert g1["bn.running_mean"].item() == 4.0 and g1["bn.num_batches_tracked"].item() == 7
    assert set(s1) == {MOMENTUM_PREFIX + "w"}
    # round 2: avg = 0.8 -> delta 0.1, v2 = 0.5*0.2 + 0.1 = 0.2, g2 = 0.9 - 0.5*0.2 = 0.8
    g2, s2 = algo.server_update(g1, _state(0.8, 5.0, 9), s1)
    torch.testing.assert_close(g2["w"], torch.tensor([0.8, 1.6]))
    torch.testing.assert_close(s2[MOMENTUM_PREFIX + "w"], torch.tensor([0.2, 0.4]))


@pytest.mark.parametrize("kwargs", [dict(beta=1.0), dict(beta=-0.1), dict(server_lr=0.0)])
def test_bad_params(kwargs) -> None:
    with pytest.raises(UsageError):
        create_algorithm("fedavgm", num_classes=3, **kwargs)
