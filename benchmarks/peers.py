"""privfedcal next to its peers: the same FedAvg experiment run three ways, whole processes.

* ``privfedcal``: ``privfedcal train`` (run folder, checkpoints, plot and table included);
* ``bare``: a plain PyTorch script: the model, ``torch.optim.SGD``, shuffled mini-batches by
  index, a sample-weighted average, a test evaluation per round, nothing else;
* ``flower``: Flower 1.41's simulation engine (``flwr.simulation.run_simulation``, Ray
  backend; ``pip install -e ".[bench]"``): a ClientApp that trains with the same loop, the
  ``FedAvg`` strategy of ``flwr.serverapp`` with a centralized test evaluation per round.

All three read the same data and client partition (privfedcal's loader and partitioner, so
the work is the same: ``--clients``, Dirichlet ``--alpha``, seed 0), train the same model
shape (digits: the MLP 64-256-128-10; ``--cnn-images N``: the CCVR/MOON CNN on N random
CIFAR-shaped images) with the same local schedule (2 local epochs, batch 32, lr 0.05,
momentum 0.9, weight decay 1e-5), one torch thread per process.

    python benchmarks/peers.py [--rounds 20] [--repeats 3] [--cnn-images 0]
        [--ways privfedcal,bare,flower]

Prints, per way, wall seconds of the whole process tree (start-up included; min / median
over repeats), CPU seconds (user + system) of the processes the run reaped (Ray's daemons
may escape this count, so Flower's CPU time is a lower bound), the ratios privfedcal / bare
and flower / privfedcal, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL = dict(local_epochs=2, batch_size=32, lr=0.05, momentum=0.9, weight_decay=1e-5)


# ---- the work every peer does: data, partition, model, local training ---------------------
def load(dataset: str, clients: int, alpha: float):
    from privfedcal.data.datasets import load_dataset
    from privfedcal.data.partition import PartitionSpec, partition_indices

    data = load_dataset(dataset)
    parts = partition_indices(data.y_train.numpy(), PartitionSpec(
        scheme="dirichlet", num_clients=clients, alpha=alpha), 0)
    return data, parts


def make_model(data, cnn: bool):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if not cnn:
        d = data.in_channels * data.image_size ** 2
        return nn.Sequential(nn.Flatten(), nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 128),
                             nn.ReLU(), nn.Linear(128, data.num_classes))
    return nn.Sequential(
        nn.Conv2d(data.in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 84), nn.ReLU(), nn.Linear(84, 256),
        nn.Linear(256, data.num_classes))


def local_train(model, x, y, seed: int) -> float:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LOCAL["lr"], momentum=LOCAL["momentum"],
                          weight_decay=LOCAL["weight_decay"])
    model.train()
    n, total, steps = len(y), 0.0, 0
    for _ in range(LOCAL["local_epochs"]):
        order = torch.randperm(n, generator=g)
        for s in range(0, n, LOCAL["batch_size"]):
            b = order[s:s + LOCAL["batch_size"]]
            if len(b) < 2:
                continue
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
    return total / max(steps, 1)


def test_accuracy(model, data) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        return float((model(data.x_test).argmax(1) == data.y_test).float().mean())


# ---- the bare loop --------------------------------------------------------------------------
def role_bare(args) -> None:
    import torch

    torch.set_num_threads(1)
    data, parts = load(args.dataset, args.clients, args.alpha)
    model = make_model(data, args.cnn)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    acc = 0.0
    for r in range(1, args.rounds + 1):
        states, weights = [], []
        for c, idx in enumerate(parts):
            idx_t = torch.as_tensor(idx)
            model.load_state_dict(global_state)
            local_train(model, data.x_train[idx_t], data.y_train[idx_t], 1000 * r + c)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
            weights.append(len(idx))
        total = sum(weights)
        global_state = {k: sum(s[k] * (w / total) for s, w in zip(states, weights, strict=True))
                        for k in global_state}
        model.load_state_dict(global_state)
        acc = test_accuracy(model, data)
    print(json.dumps({"accuracy": acc}))


# ---- Flower's simulation engine ---------------------------------------------------------------
def role_flower(args) -> None:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    torch.set_num_threads(1)
    client_app = ClientApp()
    cache: dict = {}

    def client_data(context: Context):
        if "data" not in cache:  # one Ray actor serves many virtual nodes: load once
            cache["data"] = load(args.dataset, args.clients, args.alpha)
        data, parts = cache["data"]
        idx = torch.as_tensor(parts[int(context.node_config["partition-id"])])
        return data, data.x_train[idx], data.y_train[idx]

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        data, x, y = client_data(context)
        model = make_model(data, args.cnn)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        r = int(msg.content["config"]["server-round"])
        loss = local_train(model, x, y, 1000 * r + int(context.node_config["partition-id"]))
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"train-loss": loss,
                                                       "num-examples": len(y)})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        data, _ = load(args.dataset, args.clients, args.alpha)
        model = make_model(data, args.cnn)

        def central(round_: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            return MetricRecord({"accuracy": test_accuracy(model, data)})

        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                          min_train_nodes=args.clients, min_available_nodes=args.clients)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=args.rounds, train_config=ConfigRecord({}),
                                evaluate_fn=central)
        metrics = result.evaluate_metrics_serverapp
        print(json.dumps({"accuracy": metrics[max(metrics)]["accuracy"]}), flush=True)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})


# ---- the driver ---------------------------------------------------------------------------
def run_way(way: str, args, tmp: Path, repeat: int) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    common = ["--rounds", str(args.rounds), "--clients", str(args.clients), "--alpha",
              str(args.alpha), "--dataset", args.dataset] + (["--cnn"] if args.cnn else [])
    if way == "privfedcal":
        cmd = [sys.executable, "-m", "privfedcal.cli.main", "train", "--rounds",
               str(args.rounds), "--clients", str(args.clients), "--alpha", str(args.alpha),
               "--dataset", args.dataset, "--threads", "1", "--device", "cpu",
               "--local-epochs", str(LOCAL["local_epochs"]), "--batch-size",
               str(LOCAL["batch_size"]), "--lr", str(LOCAL["lr"]), "--momentum",
               str(LOCAL["momentum"]), "--weight-decay", str(LOCAL["weight_decay"]),
               "--out", str(tmp / f"pfc{repeat}")]
        cmd += ["--model", "cnn", "--no-augment"] if args.cnn else ["--model", "mlp"]
    else:
        cmd = [sys.executable, __file__, "--role", way, *common]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{way} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return dt, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--cnn-images", type=int, default=0)
    ap.add_argument("--ways", default="privfedcal,bare,flower")
    ap.add_argument("--role", choices=["bare", "flower"], help=argparse.SUPPRESS)
    ap.add_argument("--dataset", default="digits", help=argparse.SUPPRESS)
    ap.add_argument("--cnn", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "bare":
        return role_bare(args)
    if args.role == "flower":
        return role_flower(args)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.cnn_images > 0:
            sys.path.insert(0, str(Path(__file__).parent))
            from cifar_like import make_npz

            args.dataset = f"npz:{make_npz(tmp_path / 'cifar-shaped.npz', args.cnn_images)}"
            args.cnn = True
        times: dict[str, list[float]] = {w: [] for w in ways}
        cpus: dict[str, list[float]] = {w: [] for w in ways}
        load_before = os.getloadavg()
        for r in range(args.repeats):
            for w in ways:
                dt, cpu = run_way(w, args, tmp_path, r)
                times[w].append(dt)
                cpus[w].append(cpu)
        load_after = os.getloadavg()
    what = (f"CNN, {args.cnn_images} CIFAR-shaped images" if args.cnn else "digits, MLP")
    print(f"FedAvg, {what}, {args.clients} clients (Dirichlet {args.alpha}), {args.rounds} "
          f"rounds, 2 local epochs, 1 thread; whole process, {args.repeats} repeats")
    print(f"load average (1, 5, 15 min) before {', '.join(f'{v:.1f}' for v in load_before)}; "
          f"after {', '.join(f'{v:.1f}' for v in load_after)} ({os.cpu_count()} CPUs)")
    for w in ways:
        print(f"  {w:>10}: min {min(times[w]):7.2f} s   median {statistics.median(times[w]):7.2f} s"
              f"   CPU (user + system of reaped processes) min {min(cpus[w]):7.2f} s   "
              f"median {statistics.median(cpus[w]):7.2f} s")
    if "privfedcal" in times:
        for w, label in (("bare", "privfedcal / bare"), ("flower", "flower / privfedcal")):
            if w in times:
                num, den = (times["privfedcal"], times[w]) if w == "bare" else \
                    (times[w], times["privfedcal"])
                print(f"  ratio {label}: min-to-min {min(num) / min(den):.2f}   "
                      f"median-to-median {statistics.median(num) / statistics.median(den):.2f}")
                num, den = (cpus["privfedcal"], cpus[w]) if w == "bare" else \
                    (cpus[w], cpus["privfedcal"])
                print(f"  ratio {label}, CPU: min-to-min {min(num) / min(den):.2f}   "
                      f"median-to-median {statistics.median(num) / statistics.median(den):.2f}")
    return None


if __name__ == "__main__":
    main()
