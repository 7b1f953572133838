"""Per-round wall time of the engine against a bare PyTorch loop doing the same SGD steps.

Workload: the CCVR/MOON CNN on CIFAR-shaped random data (32x32x3, 10 classes), 10 clients
(iid split), one local epoch per round, batch 64, no augmentation, CPU. The bare loop is the
practical limit: one model, the same number of SGD steps on the same data, nothing else.

    python benchmarks/engine/round_time.py [--images 10000] [--rounds 6] [--threads 2]

Prints seconds per round and the ratios engine / bare loop (target <= 1.10 for --workers 1)
and bare loop / engine with --workers 2 (> 1 means two 1-thread workers beat one 2-thread
process).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cifar_like, harness
import harness
from cifar_like import make_npz

from privfedcal.experiment import build_experiment
from privfedcal.federation.simulator import Simulator
from privfedcal.models import create_model
from privfedcal.settings.run_config import RunConfig


def bare_loop(x: torch.Tensor, y: torch.Tensor, clients: int, batch: int, rounds: int,
              threads: int) -> list[float]:
    """Seconds per round of plain SGD over the same samples, split into the same clients."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=32)
    parts = torch.arange(x.shape[0]).chunk(clients)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for idx in parts:
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
            order = idx[torch.randperm(idx.numel())]
            for s in range(0, order.numel(), batch):
                b = order[s:s + batch]
                if b.numel() < 2:
                    continue
                loss = F.cross_entropy(model(x[b]), y[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        times.append(time.perf_counter() - t0)
    return times


def engine(npz: Path, workers: int, threads: int, rounds: int, batch: int, clients: int,
           out: Path) -> list[float]:
    cfg = RunConfig.of(dataset=f"npz:{npz}", model="cnn", clients=clients, partition="iid",
                    rounds=rounds, local_epochs=1, batch_size=batch, lr=0.01, device="cpu",
                    workers=workers, threads=threads, eval_every=10_000, transcript=False,
                    augment=False)
    sim = Simulator(build_experiment(cfg), out)
    sim.run()
    # the first round starts the workers, the last one also evaluates: both are left out
    return [h["seconds"] for h in sim.history][1:-1]


def main() -> None:
    ap = harness.parser(__doc__, threads=2)
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--clients", type=int, default=10)
    args = harness.parse(ap)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        npz = make_npz(tmp / "data.npz", args.images)
        from privfedcal.data.datasets import load_dataset

        data = load_dataset(f"npz:{npz}")
        bare = bare_loop(data.x_train, data.y_train, args.clients, args.batch, args.rounds,
                         args.threads)[1:]  # the first round warms up
        e1 = engine(npz, 1, args.threads, args.rounds, args.batch, args.clients, tmp / "e1")
        e2 = engine(npz, 2, 1, args.rounds, args.batch, args.clients, tmp / "e2")
    n = args.images
    print(f"images per round: {n}  clients: {args.clients}  batch: {args.batch}  "
          f"(seconds per round: median / best of {len(e1)} rounds)")
    rows = [(f"bare loop ({args.threads} threads)", bare),
            (f"engine --workers 1 --threads {args.threads}", e1),
            ("engine --workers 2 --threads 1", e2)]
    for name, t in rows:
        print(f"{name:34s} {np.median(t):.3f} / {min(t):.3f} s  ({n / np.median(t):,.0f} img/s)")
    for name, t, target in (("workers 1 / bare", e1, "<= 1.10"), ("workers 2 / bare", e2, "< 1.00")):
        print(f"ratio engine {name}: median {np.median(t) / np.median(bare):.3f}, "
              f"best {min(t) / min(bare):.3f}   (target {target})")
    harness.finish(args, {name: {"seconds_per_round": t, **harness.stats(t)} for name, t in rows})

if __name__ == "__main__":
    main()
