"""privfedcal next to its peers: the same FedAvg experiment run several ways, whole processes.

* ``privfedcal``: ``privfedcal train`` (run folder, server-view transcript, checkpoints, plot
  and table included: the defaults);
* ``bare``: a plain PyTorch script: the model, ``torch.optim.SGD``, shuffled mini-batches by
  index, a sample-weighted average, a test evaluation per round, nothing else;
* ``flower``: Flower 1.41's simulation engine (``flwr.simulation.run_simulation``, Ray
  backend; ``pip install -e ".[bench]"``): a ClientApp that trains with the same loop, the
  ``FedAvg`` strategy of ``flwr.serverapp`` with a centralized test evaluation per round;
* ``pfl``: Apple's pfl-research (``pfl`` 0.6.0, PyTorch backend), in its own environment
  (``--pfl-python``: the interpreter of a venv with ``pip install "pfl[pytorch]==0.6.0"``):
  ``FederatedAveraging`` with ``SimulatedBackend``, ``WeightByDatapoints``, a
  ``CentralEvaluationCallback`` per round. It reads the data and the partition that the
  driver exports from privfedcal's loader (one ``.npz``), so the work is the same.

``--dp`` runs user-level DP-FedAvg instead (each client's update clipped to ``--clip``,
Gaussian noise on the sum, the same noise multiplier everywhere: RDP, no amplification
(q = 1, every client every round), ``--epsilon``/``--delta`` over the rounds):
``privfedcal train --dp-updates``, pfl's ``CentrallyAppliedPrivacyMechanism`` of a
``GaussianMechanism`` from its ``RDPPrivacyAccountant`` with ``WeightByUser``, Flower's
``DifferentialPrivacyServerSideFixedClipping`` around ``FedAvg``; the bare loop is left out.

All three read the same data and client partition (privfedcal's loader and partitioner, so
the work is the same: ``--clients``, Dirichlet ``--alpha``, seed 0), train the same model
shape (digits: the MLP 64-256-128-10; ``--cnn-images N``: the CCVR/MOON CNN on N random
CIFAR-shaped images) with the same local schedule (2 local epochs, batch 32, lr 0.05,
momentum 0.9, weight decay 1e-5), one torch thread per process.

    python benchmarks/engine/peers.py [--rounds 20] [--repeats 3] [--cnn-images 0]
        [--ways privfedcal,bare,flower,pfl] [--pfl-python PATH] [--dp]

Prints, per way, wall seconds of the whole process tree (start-up included; min / median
over repeats), the median seconds of a round (as each tool times it: privfedcal's
``metrics.jsonl``, pfl between central iterations, the bare loop and Flower between rounds,
evaluation included), CPU seconds (user + system) of the processes the run reaped (Ray's
daemons may escape this count, so Flower's CPU time is a lower bound), the final accuracy,
each peer's times over privfedcal's, and the load average before and after. Ways run
interleaved (one repeat of each, then the next).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cifar_like, harness
import harness  # noqa: E402

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
    acc, seconds = 0.0, []
    for r in range(1, args.rounds + 1):
        t0 = time.perf_counter()
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
        seconds.append(time.perf_counter() - t0)
    print(json.dumps({"accuracy": acc, "round_seconds": seconds}))


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

        ticks = [time.perf_counter()]

        def central(round_: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            acc = test_accuracy(model, data)
            ticks.append(time.perf_counter())  # round 0 is the initial model's evaluation
            return MetricRecord({"accuracy": acc})

        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                          min_train_nodes=args.clients, min_available_nodes=args.clients)
        if args.dp:
            from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

            strategy = DifferentialPrivacyServerSideFixedClipping(
                strategy, noise_multiplier=args.noise_multiplier, clipping_norm=args.clip,
                num_sampled_clients=args.clients)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=args.rounds, train_config=ConfigRecord({}),
                                evaluate_fn=central)
        metrics = result.evaluate_metrics_serverapp
        seconds = [b - a for a, b in zip(ticks[1:], ticks[2:], strict=False)]
        print(json.dumps({"accuracy": metrics[max(metrics)]["accuracy"],
                          "round_seconds": seconds}), flush=True)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})

# ---- pfl-research -----------------------------------------------------------------------------
def export_data(args, path: Path) -> None:
    """The data and partition every way trains on, for a process without privfedcal."""
    import numpy as np

    data, parts = load(args.dataset, args.clients, args.alpha)
    np.savez(path, x_train=data.x_train.numpy(), y_train=data.y_train.numpy(),
             x_test=data.x_test.numpy(), y_test=data.y_test.numpy(),
             offsets=np.cumsum([0] + [len(p) for p in parts]),
             order=np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]),
             num_classes=data.num_classes, in_channels=data.in_channels,
             image_size=data.image_size)


def role_pfl(args) -> None:
    from types import SimpleNamespace

    import numpy as np
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(1)
    npz = np.load(args.data)
    data = SimpleNamespace(num_classes=int(npz["num_classes"]),
                           in_channels=int(npz["in_channels"]),
                           image_size=int(npz["image_size"]))
    x_train, y_train = torch.from_numpy(npz["x_train"]), torch.from_numpy(npz["y_train"])
    offsets, order = npz["offsets"], npz["order"]
    users = {c: [x_train[order[offsets[c]:offsets[c + 1]]],
                 y_train[order[offsets[c]:offsets[c + 1]]]] for c in range(args.clients)}

    class Net(torch.nn.Module):
        """The same network, with the loss and metrics pfl's PyTorch model calls."""

        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(data, args.cnn)

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=True):
            self.eval()
            logits = self(x)
            n = len(y)
            return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                    "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}

    net = Net()
    model = PyTorchModel(
        net, local_optimizer_create=lambda params, lr: torch.optim.SGD(
            params, lr=lr, momentum=LOCAL["momentum"], weight_decay=LOCAL["weight_decay"]),
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    train = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse",
                                                                 list(users)))
    central = Dataset((torch.from_numpy(npz["x_test"]), torch.from_numpy(npz["y_test"])))
    post = []
    if args.dp:
        from pfl.privacy import (
            CentrallyAppliedPrivacyMechanism,
            GaussianMechanism,
            RDPPrivacyAccountant,
        )

        accountant = RDPPrivacyAccountant(num_compositions=args.rounds, sampling_probability=1.0,
                                          mechanism="gaussian", epsilon=args.epsilon,
                                          delta=args.delta)
        post = [WeightByUser(), CentrallyAppliedPrivacyMechanism(
            GaussianMechanism.from_privacy_accountant(accountant, args.clip))]
    else:
        post = [WeightByDatapoints()]
    backend = SimulatedBackend(training_data=train, val_data=None, postprocessors=post)
    eval_params = NNEvalHyperParams(local_batch_size=1024)
    ticks: list[float] = []

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            ticks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            ticks.append(time.perf_counter())
            return False, Metrics()

    evaluation = CentralEvaluationCallback(central, eval_params, frequency=1)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds,
                                           evaluation_frequency=1,
                                           train_cohort_size=args.clients, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=LOCAL["local_epochs"],
                                              local_learning_rate=LOCAL["lr"],
                                              local_batch_size=LOCAL["batch_size"]),
        model_eval_params=eval_params, callbacks=[evaluation, Clock()],
        send_metrics_to_platform=False)
    with torch.no_grad():
        net.eval()
        acc = float((net(central.raw_data[0]).argmax(1) == central.raw_data[1]).float().mean())
    print(json.dumps({"accuracy": acc, "round_seconds": [b - a for a, b in zip(
        ticks, ticks[1:], strict=False)]}), flush=True)


# ---- the driver ---------------------------------------------------------------------------
def run_way(way: str, args, tmp: Path, repeat: int) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    common = ["--rounds", str(args.rounds), "--clients", str(args.clients), "--alpha",
              str(args.alpha), "--dataset", args.dataset] + (["--cnn"] if args.cnn else [])
    if args.dp:
        common += ["--dp", "--epsilon", str(args.epsilon), "--delta", str(args.delta),
                   "--clip", str(args.clip), "--noise-multiplier", str(args.noise_multiplier)]
    out = tmp / f"pfc{repeat}"
    python = sys.executable
    if way == "privfedcal":
        cmd = [python, "-m", "privfedcal.cli.main", "train", "--rounds",
               str(args.rounds), "--clients", str(args.clients), "--alpha", str(args.alpha),
               "--dataset", args.dataset, "--threads", "1", "--device", "cpu",
               "--local-epochs", str(LOCAL["local_epochs"]), "--batch-size",
               str(LOCAL["batch_size"]), "--lr", str(LOCAL["lr"]), "--momentum",
               str(LOCAL["momentum"]), "--weight-decay", str(LOCAL["weight_decay"]),
               "--out", str(out)]
        cmd += ["--model", "cnn", "--no-augment"] if args.cnn else ["--model", "mlp"]
        if args.dp:
            cmd += ["--dp-updates", "--dp-eps", str(args.epsilon), "--dp-delta",
                    str(args.delta), "--dp-update-clip", str(args.clip)]
    elif way == "pfl":
        python = args.pfl_python
        cmd = [python, __file__, "--role", way, "--data", str(tmp / "peer-data.npz"), *common]
        env.pop("PYTHONPATH")  # pfl's environment has no privfedcal
    else:
        cmd = [python, __file__, "--role", way, *common]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{way} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if way == "privfedcal":
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
        result = {"accuracy": json.loads((out / "summary.json").read_text())["accuracy"],
                  "round_seconds": [r["seconds"] for r in rows]}
        if args.dp:
            result["noise_multiplier"] = json.loads((out / "summary.json").read_text())[
                "privacy"]["user_dp"].get("noise_multiplier")
    else:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall": dt, "cpu": cpu, "accuracy": float(result["accuracy"]),
            "round": statistics.median(result["round_seconds"]),
            "noise_multiplier": result.get("noise_multiplier")}


def noise_multiplier(args) -> float:
    """The multiplier every DP way uses: opacus' RDP accountant, q = 1, ``rounds`` steps."""
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(target_epsilon=args.epsilon, target_delta=args.delta,
                                sample_rate=1.0, steps=args.rounds, accountant="rdp",
                                epsilon_tolerance=0.001)


def main() -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--cnn-images", type=int, default=0)
    ap.add_argument("--ways", default="privfedcal,bare,flower")
    ap.add_argument("--pfl-python", default=None,
                    help="python of an environment with pfl[pytorch] 0.6.0 (way 'pfl')")
    ap.add_argument("--dp", action="store_true", help="user-level DP-FedAvg in every way")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--noise-multiplier", type=float, default=math.nan,
                    help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=["bare", "flower", "pfl"], help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dataset", default="digits", help=argparse.SUPPRESS)
    ap.add_argument("--cnn", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse(ap)
    roles = {"bare": role_bare, "flower": role_flower, "pfl": role_pfl}
    if args.role:
        return roles[args.role](args)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if "pfl" in ways and not args.pfl_python:
        raise SystemExit("way pfl needs --pfl-python (a venv with pip install "
                         "'pfl[pytorch]==0.6.0')")
    if args.dp:
        ways = [w for w in ways if w != "bare"]
        args.noise_multiplier = noise_multiplier(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.cnn_images > 0:
            from cifar_like import make_npz

            args.dataset = f"npz:{make_npz(tmp_path / 'cifar-shaped.npz', args.cnn_images)}"
            args.cnn = True
        if "pfl" in ways:
            export_data(args, tmp_path / "peer-data.npz")
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        load_before = os.getloadavg()
        for r in range(args.repeats):
            for w in ways:
                runs[w].append(run_way(w, args, tmp_path, r))
        load_after = os.getloadavg()
    what = (f"CNN, {args.cnn_images} CIFAR-shaped images" if args.cnn else "digits, MLP")
    dp = (f"; user-level DP-FedAvg, epsilon {args.epsilon:g}, delta {args.delta:g}, clip "
          f"{args.clip:g}, noise multiplier {args.noise_multiplier:.3f} (RDP, q = 1)"
          if args.dp else "")
    print(f"FedAvg, {what}, {args.clients} clients (Dirichlet {args.alpha}), {args.rounds} "
          f"rounds, 2 local epochs, 1 thread; whole process, {args.repeats} repeats, "
          f"interleaved{dp}")
    print(f"load average (1, 5, 15 min) before {', '.join(f'{v:.1f}' for v in load_before)}; "
          f"after {', '.join(f'{v:.1f}' for v in load_after)} ({os.cpu_count()} CPUs)")

    def med(w: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[w])

    for w in ways:
        print(f"  {w:>10}: wall min {min(x['wall'] for x in runs[w]):7.2f} s  median "
              f"{med(w, 'wall'):7.2f} s   round median {med(w, 'round'):.4f} s   CPU median "
              f"{med(w, 'cpu'):7.2f} s   accuracy {med(w, 'accuracy'):.4f}")
    if "privfedcal" in ways:
        if args.dp:
            z = runs["privfedcal"][0]["noise_multiplier"]
            print(f"  privfedcal's own noise multiplier: {z}")
        for w in ways:
            if w != "privfedcal":
                print(f"  {w} / privfedcal: whole process {med(w, 'wall') / med('privfedcal', 'wall'):.2f}"
                      f"   per round {med(w, 'round') / med('privfedcal', 'round'):.2f}")
    harness.finish(args, {w: {"runs": runs[w], "wall": harness.stats([x["wall"] for x in runs[w]]),
                              "round_median": med(w, "round"), "accuracy": med(w, "accuracy")}
                          for w in ways})
    return None


if __name__ == "__main__":
    main()
