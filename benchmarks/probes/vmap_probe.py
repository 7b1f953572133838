"""How much batching clients can gain on this machine at all: the digits MLP (64-256-128-10),
K clients x S steps of batch 32, SGD with momentum 0.9, timed three ways with nothing of
privfedcal in them:

* ``seq``: a plain sequential loop, a fresh model and ``torch.optim.SGD`` per client;
* ``seq_reuse``: the same with one model whose state is loaded per client (cheaper);
* ``vec``: ``vmap(grad(loss))`` over the K clients' stacked parameters and one momentum
  update of the stacks per step (what a vectorised trainer does, without its bookkeeping:
  equal clients, no padding, no per-client data order).

The ratios bound what ``--client-batch`` can reach here (docs/results/engine.md, "Vectorised
local training"). Random data; medians of 7 runs after one warm-up.

    python benchmarks/probes/vmap_probe.py [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def probe(k: int, steps: int, repeats: int = 7) -> dict[str, float]:
    x, y = torch.randn(k, steps, 32, 64), torch.randint(0, 10, (k, steps, 32))
    base = mlp()

    def sgd_steps(model: nn.Module, c: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for s in range(steps):
            loss = F.cross_entropy(model(x[c, s]), y[c, s])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def seq() -> None:
        for c in range(k):
            model = mlp()
            model.load_state_dict(base.state_dict())
            sgd_steps(model, c)

    def seq_reuse() -> None:
        model, state = mlp(), base.state_dict()
        for c in range(k):
            model.load_state_dict(state)
            sgd_steps(model, c)

    def loss_of(params, xb, yb):
        return F.cross_entropy(functional_call(base, params, (xb,)), yb)

    per_client_grad = vmap(grad(loss_of))

    def vec() -> None:
        params = {n: t.detach().unsqueeze(0).repeat(k, *[1] * t.ndim)
                  for n, t in base.named_parameters()}
        bufs = {n: torch.zeros_like(t) for n, t in params.items()}
        for s in range(steps):
            grads = per_client_grad(params, x[:, s], y[:, s])
            for n, g in grads.items():
                bufs[n].mul_(0.9).add_(g)
                params[n].sub_(0.05 * bufs[n])

    engines = {"seq": seq, "seq_reuse": seq_reuse, "vec": vec}
    for fn in engines.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for k, steps in ((10, 10), (100, 2)):
        t = probe(k, steps)
        print(f"K={k} S={steps} threads={args.threads}: "
              + ", ".join(f"{name} {v * 1000:.1f} ms" for name, v in t.items())
              + f"; speedup seq/vec {t['seq'] / t['vec']:.2f}x, "
                f"seq_reuse/vec {t['seq_reuse'] / t['vec']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
