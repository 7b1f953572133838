"""Training steps per second on whatever device is present: privfedcal's local training
against a bare eager PyTorch loop doing the same steps.

Workload: the CCVR/MOON CNN (or ``--model``) on random CIFAR-shaped data (``--images``,
32x32x3, 10 classes) held on the device, batch ``--batch-size``, SGD with momentum 0.9 and
weight decay 1e-5, random crop (4-pixel padding) + flip on every batch. privfedcal runs
``train_client`` (the code both trainers use; randomness drawn per epoch on the CPU and copied
without blocking; bf16 autocast per ``--precision``); the bare loop draws its crops and flips
on the device with a device generator, ``torch.optim.SGD``, and the same precision.

    python benchmarks/engine/device_steps.py [--device auto] [--model cnn] [--images 10000]
        [--batch-size 64] [--epochs 2] [--repeats 5] [--precision auto]

Prints steps/s of both (min / median over repeats, each a fresh run of ``--epochs`` epochs
after one warm-up epoch) and the ratio privfedcal / bare (1.0 = as fast as the bare loop).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_loop(model, x, y, epochs: int, batch: int, mixed: bool, seed: int) -> int:
    device = x.device
    g = torch.Generator(device=device).manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    n, steps = x.shape[0], 0
    ar_h = torch.arange(x.shape[2], device=device)
    ar_w = torch.arange(x.shape[3], device=device)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g, device=device)
        for s in range(0, n, batch):
            b = order[s:s + batch]
            xb, yb = x[b], y[b]
            k = xb.shape[0]
            off = torch.randint(0, 9, (2, k), generator=g, device=device)
            flip = torch.rand(k, generator=g, device=device) < 0.5
            rows = off[0, :, None] + ar_h
            cols = off[1, :, None] + ar_w
            cols = torch.where(flip[:, None], cols.flip(-1), cols)
            p = F.pad(xb, (4,) * 4)
            c, h, w, wp = xb.shape[1], xb.shape[2], xb.shape[3], p.shape[-1]
            xb = p.gather(2, rows[:, None, :, None].expand(k, c, h, wp)).gather(
                3, cols[:, None, None, :].expand(k, c, h, w))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed
                                and device.type == "cuda"):
                loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
    return steps


def main() -> None:
    from privfedcal.algorithms import create_algorithm
    from privfedcal.federation.local import (
        LocalSpec,
        choose_mixed_precision,
        clone_state,
        train_client,
    )
    from privfedcal.models import create_model
    from privfedcal.settings.sections import DataSettings, TrainingSettings

    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's)")
    args = harness.parse(ap)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.images, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (args.images,), generator=g).to(device)
    model = create_model(args.model, num_classes=10, in_channels=3, image_size=32,
                         generator=torch.Generator().manual_seed(1)).to(device)
    algo = create_algorithm("fedavg", num_classes=10)
    mixed = choose_mixed_precision(model, device, args.precision)
    spec = LocalSpec(TrainingSettings(local_epochs=args.epochs, batch_size=args.batch_size,
                                      lr=0.01, momentum=0.9, weight_decay=1e-5, seed=0),
                     DataSettings(augment=True), mixed_precision=mixed)
    start = clone_state(model)
    idx = torch.arange(args.images, device=device)
    steps = args.epochs * -(-args.images // args.batch_size)

    def ours(r: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        train_client(model, algo, start, None, x, y, idx, spec, r, 0)
        sync(device)
        return steps / (time.perf_counter() - t0)

    def bare(r: int) -> float:
        model.load_state_dict(start)
        sync(device)
        t0 = time.perf_counter()
        n = bare_loop(model, x, y, args.epochs, args.batch_size, mixed, r)
        sync(device)
        return n / (time.perf_counter() - t0)

    ours(0), bare(0)  # warm-up: kernels, allocator, autotuning
    rates: dict[str, list[float]] = {"privfedcal": [], "bare": []}
    for r in range(1, args.repeats + 1):  # interleaved, so drifting load hits both alike
        rates["privfedcal"].append(ours(r))
        rates["bare"].append(bare(r))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"{args.model}, {args.images} images 32x32x3, batch {args.batch_size}, "
          f"{args.epochs} epochs per repeat, crop+flip, {'bf16 autocast' if mixed else 'fp32'}"
          f", {name}")
    for k, v in rates.items():
        print(f"  {k:>10}: {max(v):8.1f} / {statistics.median(v):8.1f} steps/s (best / median)")
    print(f"  ratio privfedcal / bare: best {max(rates['privfedcal']) / max(rates['bare']):.3f}"
          f"   median {statistics.median(rates['privfedcal']) / statistics.median(rates['bare']):.3f}")
    harness.finish(args, {k: {"steps_per_s": v, "best": max(v), "median": statistics.median(v)}
                          for k, v in rates.items()})


if __name__ == "__main__":
    main()
