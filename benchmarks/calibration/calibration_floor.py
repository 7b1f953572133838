"""The least CCVR can cost against a training round: one client's work, one thread.

CCVR's clients compute their class statistics with the final global model, so each needs one
forward pass over all of its data; a round trains ``E`` epochs over the same data. This
prints the CPU time (``time.process_time``, min / median over ``--repeats``) of, for one
client of ``--images`` CIFAR-shaped random images through the CCVR/MOON CNN:

* the forward pass alone (``extract_features``),
* the whole statistics payload (``StatsTask.compute``: forward + per-class sums in float64),
* one local training epoch (``PlainSGD``, batch 32, the training loop's update),

and the ratio payload / (E x epoch): the client part of CCVR against a round, before any
server work, pool transfer or test evaluation. Two parts of the calibration path beside it:
the test evaluation of ``--test-images`` images in one batch of 2,048 against batches of
``CPU_INFERENCE_BATCH`` (256), and the NaN/Inf check of one client's covariance upload
(10 x 256 x 256 float64) by ``torch.isfinite(t).all()`` against ``all_finite``.

    python benchmarks/calibration/calibration_floor.py [--images 500] [--local-epochs 2] [--repeats 5]
        [--test-images 1000]
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

from privfedcal.calibration.ccvr import StatsTask, extract_features
from privfedcal.federation.local import CPU_INFERENCE_BATCH, PlainSGD, evaluate
from privfedcal.models.model_registry import create_model
from privfedcal.privacy.bound import NoBound
from privfedcal.tensors import all_finite


def cpu_times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return out


def main() -> None:
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--test-images", type=int, default=1000)
    args = harness.parse(ap)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=32, generator=g)
    x = torch.rand(args.images, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.images,), generator=g)
    task = StatsTask(num_classes=10)

    model.eval()
    fwd = cpu_times(lambda: extract_features(model, x, 1024), args.repeats)
    stats = cpu_times(lambda: task.compute(model, x, y, NoBound()), args.repeats)
    model.train()
    opt = PlainSGD(list(model.parameters()), lr=0.01, momentum=0.9, weight_decay=1e-5)

    def epoch() -> None:
        for s in range(0, args.images, args.batch_size):
            loss = F.cross_entropy(model(x[s:s + args.batch_size]), y[s:s + args.batch_size])
            opt.zero_grad()
            loss.backward()
            opt.step()

    ep = cpu_times(epoch, args.repeats)
    print(f"CNN, {args.images} CIFAR-shaped images, one thread, CPU seconds (min / median of "
          f"{args.repeats})")
    for name, ts in (("forward (extract_features)", fwd), ("statistics payload", stats),
                     ("one training epoch", ep)):
        print(f"  {name:28s} {min(ts):.4f} / {statistics.median(ts):.4f}")
    e = args.local_epochs
    print(f"  forward / epoch            {min(fwd) / min(ep):.3f}")
    print(f"  client part of CCVR / round of E = {e}: {min(stats) / (e * min(ep)):.3f} "
          f"(forward alone {min(fwd) / (e * min(ep)):.3f})")

    state = {k: v.clone() for k, v in model.state_dict().items()}
    xt = torch.rand(args.test_images, 3, 32, 32, generator=g)
    yt = torch.randint(0, 10, (args.test_images,), generator=g)
    # evaluate() caps its batch on a CPU; the uncapped cost is one batch of 2,048, measured
    # by calling it on the CPU tensors through the same forward with the cap lifted
    big = cpu_times(lambda: _evaluate_uncapped(model, state, xt, yt), args.repeats)
    capped = cpu_times(lambda: evaluate(model, state, xt, yt, 10), args.repeats)
    cov = torch.randn(10, 256, 256, dtype=torch.float64, generator=g)
    mask = cpu_times(lambda: [bool(torch.isfinite(cov).all()) for _ in range(100)], args.repeats)
    fast = cpu_times(lambda: [all_finite(cov) for _ in range(100)], args.repeats)
    print(f"  test pass, {args.test_images} images: batch 2048 {min(big):.4f}, batches of "
          f"{CPU_INFERENCE_BATCH} {min(capped):.4f}")
    print(f"  NaN/Inf check of a 10 x 256 x 256 float64 upload: isfinite().all() "
          f"{min(mask) * 10:.2f} ms, all_finite {min(fast) * 10:.2f} ms")
    harness.finish(args, {"cpu_seconds": {
        "forward": harness.stats(fwd), "statistics payload": harness.stats(stats),
        "training epoch": harness.stats(ep), "test pass, batch 2048": harness.stats(big),
        f"test pass, batches of {CPU_INFERENCE_BATCH}": harness.stats(capped),
        "100 isfinite().all()": harness.stats(mask), "100 all_finite": harness.stats(fast)}})


@torch.no_grad()
def _evaluate_uncapped(model, state, x, y) -> None:
    """The forward and loss of ``evaluate`` in one batch of 2,048 (its size before the cap)."""
    model.load_state_dict(state)
    model.eval()
    for s in range(0, x.shape[0], 2048):
        F.cross_entropy(model(x[s:s + 2048]), y[s:s + 2048], reduction="sum")


if __name__ == "__main__":
    main()
