"""PlainSGD takes exactly the steps of torch.optim.SGD (bitwise), on CPU and foreach paths."""

from __future__ import annotations

import pytest
import torch

from privfedcal.federation.local import PlainSGD


def _run(opt_factory) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    frozen = torch.nn.Linear(2, 2)  # never gets a gradient: must be skipped, no buffer
    params = list(net.parameters()) + list(frozen.parameters())
    opt = opt_factory(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(9, 5, generator=g)
        y = torch.randint(0, 3, (9,), generator=g)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("momentum,wd", [(0.9, 1e-5), (0.0, 0.0), (0.5, 0.0), (0.0, 1e-3)])
def test_plain_sgd_equals_torch_sgd_bitwise(momentum: float, wd: float) -> None:
    ref = _run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum, weight_decay=wd))
    ours = _run(lambda ps: PlainSGD(ps, lr=0.05, momentum=momentum, weight_decay=wd))
    for a, b in zip(ref, ours, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum,wd", [(0.9, 1e-5), (0.0, 0.0)])
def test_foreach_path_matches_torch_foreach_sgd(momentum: float, wd: float,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # the accelerator path, run on CPU tensors: compared with torch's own foreach SGD
    ref = _run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum, weight_decay=wd,
                                          foreach=True))
    original = PlainSGD.step

    def step_foreach(self: PlainSGD) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in live]
        with torch.no_grad():
            self._step_foreach(live, params, [p.grad for p in params])

    monkeypatch.setattr(PlainSGD, "step", step_foreach)
    ours = _run(lambda ps: PlainSGD(ps, lr=0.05, momentum=momentum, weight_decay=wd))
    monkeypatch.setattr(PlainSGD, "step", original)
    for a, b in zip(ref, ours, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
