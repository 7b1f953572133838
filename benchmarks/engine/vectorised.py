"""Local training of one round: the sequential trainer vs the vectorised one (--client-batch)
vs a bare sequential PyTorch loop, on the same clients, the same steps and the same seeds.

Settings: the digits MLP (the default run: dirichlet 0.1, batch 32, 2 local epochs) with 10
and 100 clients per round, and the CCVR/MOON CNN on CIFAR-shaped random data (32x32x3,
iid, batch 64, 1 local epoch) with 10 clients. Every client of a round is in one group
(--client-batch = clients per round).

    python benchmarks/engine/vectorised.py [--repeats 5] [--threads 2] [--cnn-images 5000]

Prints per setting and engine the min/median wall and CPU seconds of one round's local
training (engines interleaved, after one warm-up call each), the peak resident memory above
the start of the call (VmHWM, reset before each call), and ``speedup <x>`` = sequential
median / vectorised median (wall; CPU in brackets: the steadier figure on a shared machine).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cifar_like, harness
import harness
from cifar_like import make_npz

from privfedcal.experiment import build_experiment
from privfedcal.federation.local import PlainSGD, clone_state
from privfedcal.federation.vectorised import VectorisedTrainer
from privfedcal.federation.workers import InProcessTrainer, TrainJob
from privfedcal.settings.run_config import RunConfig


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measured(fn) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, peak MiB of resident memory above the
    level at the call's start). CPU time is the steadier figure on a shared machine."""
    try:  # "5" resets the peak resident size VmHWM (Linux)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    base = _rss_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, max(0, _rss_kib("VmHWM") - base) / 1024


def bare_loop(exp, jobs: list[TrainJob]) -> None:
    """The same SGD steps with one model and nothing else: no states, hooks or augmentation
    bookkeeping (the practical limit of a sequential trainer)."""
    spec, model = exp.spec, exp.model
    x_all, y_all = exp.data.x_train, exp.data.y_train
    for job in jobs:
        opt = PlainSGD([p for p in model.parameters() if p.requires_grad], lr=spec.training.lr,
                       momentum=spec.training.momentum, weight_decay=spec.training.weight_decay)
        n = job.idx.numel()
        for _ in range(spec.training.local_epochs):
            order = job.idx[torch.randperm(n)]
            for s in range(0, n, spec.training.batch_size):
                b = order[s:s + spec.training.batch_size]
                if b.numel() < 2 and n >= 2:
                    continue
                loss = F.cross_entropy(model(x_all[b]), y_all[b])
                opt.zero_grad()
                loss.backward()
                opt.step()


def bench(name: str, cfg: RunConfig, repeats: int) -> dict:
    exp = build_experiment(cfg)
    global_state = clone_state(exp.model)
    jobs = [TrainJob(c, exp.parts[c], None) for c in range(cfg.data.clients)]
    seq = InProcessTrainer(exp.model, exp.algo, exp.data.x_train, exp.data.y_train, exp.spec)
    vec = VectorisedTrainer(exp.model, exp.algo, exp.data.x_train, exp.data.y_train, exp.spec,
                            cfg.data.clients)
    engines = {"sequential": lambda: seq.train(global_state, jobs, 1),
               "vectorised": lambda: vec.train(global_state, jobs, 1),
               "bare loop": lambda: bare_loop(exp, jobs)}
    for fn in engines.values():  # warm-up: first-call costs (vmap tracing, allocator)
        fn()
    times: dict[str, list[float]] = {k: [] for k in engines}
    cpus: dict[str, list[float]] = {k: [] for k in engines}
    peaks: dict[str, float] = dict.fromkeys(engines, 0.0)
    for _ in range(repeats):  # interleaved, so a burst of load hits every engine alike
        for key, fn in engines.items():
            dt, cpu, peak = measured(fn)
            times[key].append(dt)
            cpus[key].append(cpu)
            peaks[key] = max(peaks[key], peak)
    sizes = [int(p.numel()) for p in exp.parts]
    print(f"== {name}: {cfg.data.clients} clients ({min(sizes)}-{max(sizes)} samples), model "
          f"{exp.model_name}, batch {exp.spec.training.batch_size}, "
          f"{exp.spec.training.local_epochs} local "
          f"epoch(s), {torch.get_num_threads()} thread(s)")
    for key in engines:
        print(f"  {key:<11} wall min {min(times[key]):.3f} s  median "
              f"{statistics.median(times[key]):.3f} s | CPU min {min(cpus[key]):.3f} s  median "
              f"{statistics.median(cpus[key]):.3f} s | peak +{peaks[key]:.1f} MiB")
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpus.items()}
    print(f"  speedup {med['sequential'] / med['vectorised']:.2f}x over the sequential trainer "
          f"(wall medians; CPU medians {cmed['sequential'] / cmed['vectorised']:.2f}x), "
          f"{med['bare loop'] / med['vectorised']:.2f}x over the bare loop "
          f"(CPU {cmed['bare loop'] / cmed['vectorised']:.2f}x)")
    return {key: {"wall": harness.stats(times[key]), "cpu": harness.stats(cpus[key]),
                  "peak_mib": peaks[key]} for key in engines}


def main() -> None:
    ap = harness.parser(__doc__, repeats=5, threads=2)
    ap.add_argument("--cnn-images", type=int, default=5000)
    args = harness.parse(ap)
    torch.set_num_threads(args.threads)
    base = dict(device="cpu", threads=args.threads, seed=0, data_seed=0, transcript=False,
                rounds=1)
    results = {
        "digits MLP, 10 clients": bench("digits MLP", RunConfig.of(dataset="digits", clients=10,
                                                                **base), args.repeats),
        "digits MLP, 100 clients": bench("digits MLP", RunConfig.of(
            dataset="digits", clients=100, alpha=1.0, min_size=5, **base), args.repeats)}
    with tempfile.TemporaryDirectory() as tmp:
        npz = make_npz(Path(tmp) / "cifar_like.npz", args.cnn_images)
        results["CIFAR-shaped CNN, 10 clients"] = bench(
            "CIFAR-shaped CNN", RunConfig.of(dataset=f"npz:{npz}", model="cnn", clients=10,
                                          partition="iid", local_epochs=1, batch_size=64,
                                          **base), args.repeats)
    harness.finish(args, results)


if __name__ == "__main__":
    main()
