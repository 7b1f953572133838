"""privfedcal next to its peers: the same FedAvg experiment, the same work per round, each
round timed the same way, in interleaved pairs of whole processes.

* ``privfedcal``: ``privfedcal train`` as users run it (run folder, server-view transcript,
  checkpoint every round, metrics, log lines, plot and table: the defaults); with
  ``--client-batch K`` it trains K clients at once with its vectorised trainer (the same
  SGD steps on the same batches, within float32 rounding: a privfedcal option, named in the
  output), its training work counted from the step plan that trainer runs (peer_meter.py);
  the MLP's steps run by hand (``federation/chain_steps.py``, the same numbers bit for bit as
  autograd's) and are counted where they run;
* ``bare``: a plain PyTorch script: the model, ``torch.optim.SGD``, shuffled mini-batches by
  index, a sample-weighted average, the test evaluation, nothing else;
* ``flower``: Flower 1.41's simulation engine (``flwr.simulation.run_simulation``, Ray
  backend; ``pip install -e ".[bench]"``): a ClientApp that trains with the bare loop's
  code, the ``FedAvg`` strategy of ``flwr.serverapp`` (our choice of strategy) with the test
  evaluation as its ``evaluate_fn`` and no federated evaluation (``fraction_evaluate=0``);
* ``pfl``: Apple's pfl-research (``pfl`` 0.6.0, PyTorch backend) in its own environment
  (``--pfl-python``: the interpreter of a venv with ``pip install "pfl[pytorch]==0.6.0"``;
  the default is this interpreter when it imports ``pfl``): ``FederatedAveraging`` with
  ``SimulatedBackend``, ``WeightByDatapoints``, the ``minimize_reuse`` user sampler (our
  choice; every client is in every cohort), the test evaluation by pfl's
  ``CentralEvaluationCallback`` every round. It reads the data and partition that the
  driver exports from privfedcal's loader (one ``.npz``).

The same work per round in every way: each of the 10 clients trains 2 local epochs of SGD
(batch 32, lr 0.05, momentum 0.9, weight decay 1e-5, a last batch of one skipped) on the
same data and partition (privfedcal's loader and Dirichlet ``--alpha`` split, seed 0) and the
same network (digits: the MLP 64-256-128-10; ``--cnn-images N``: the CCVR/MOON CNN on N
random CIFAR-shaped images), the server averages by samples, and the global model is
evaluated on the test set once per round. No way evaluates the clients' data: pfl's
``NNAlgorithmParams.evaluation_frequency`` (the clients' training data evaluated before and
after local training) is set to the number of rounds, so only pfl's first central iteration
does it, and that round is outside the timed ones. One torch thread per process.

Timing: every way writes a line at the end of each round (privfedcal its own progress line,
printed after the round's metrics, log and checkpoint are written; the others a
``peer_meter`` line); the driver stamps the lines as they arrive. A round is the wall time
between the ends of two consecutive rounds (so the first round, which has no start line,
is not timed); a run's round time is the median over its timed rounds. Whole process is
the wall time of the process tree, start-up included. CPU is user + system time of the
processes the run reaped (Ray's daemons escape it: Flower's CPU is a lower bound).

Pairs: repeat r runs every way once, in the order of ``--ways`` for even r and reversed for
odd r. Each peer's ratio to privfedcal (peer / privfedcal: above 1, privfedcal is faster)
is taken within each repeat; the median of those paired ratios and their range are printed,
with the load average (``os.getloadavg``) before and after.

``--dp`` runs user-level DP-FedAvg instead (each client's update clipped to ``--clip``,
Gaussian noise on the sum, the same noise multiplier everywhere: RDP, no amplification
(q = 1, every client every round), ``--epsilon``/``--delta`` over the rounds):
``privfedcal train --dp-updates``, pfl's ``CentrallyAppliedPrivacyMechanism`` of a
``GaussianMechanism`` from its ``RDPPrivacyAccountant`` with ``WeightByUser``, Flower's
``DifferentialPrivacyServerSideFixedClipping`` around ``FedAvg``; the bare loop is left out.

``--table`` runs every row of the peers table of docs/results/engine.md (FedAvg on the
digits MLP with every way; DP-FedAvg at epsilon 8, clip 0.05 with privfedcal, pfl and
Flower; with ``--cnn-images N`` also FedAvg on the CNN for ``--cnn-rounds``) and prints it.

``--count`` runs each way once with its work counted from inside the run (``peer_meter``:
SGD steps, training samples, evaluation samples per timed round), prints the counts and
whether every way did the same work; exit status 1 if not.

    python benchmarks/engine/peers.py [--rounds 20] [--repeats 7] [--cnn-images 0]
        [--ways privfedcal,bare,flower,pfl] [--pfl-python PATH] [--dp] [--table] [--count]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # benchmarks/ (cifar_like, harness), peer_meter
import harness  # noqa: E402
from peer_meter import TICK, Meter, round_work, work_differences  # noqa: E402

LOCAL = dict(local_epochs=2, batch_size=32, lr=0.05, momentum=0.9, weight_decay=1e-5)
#: privfedcal's own end-of-round line on stderr (``privfedcal.cli.run_progress``)
PRIVFEDCAL_ROUND = re.compile(r"^round (\d+)/\d+: ")


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


def make_meter(args, data) -> Meter:
    return Meter(args.count, in_channels=data.in_channels, image_size=data.image_size,
                 cnn=args.cnn)


def local_train(model, x, y, seed: int) -> float:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LOCAL["lr"], momentum=LOCAL["momentum"],
                          weight_decay=LOCAL["weight_decay"])
    model.train()
    n, total, steps = len(y), 0.0, 0
    for _ in range(LOCAL["local_epochs"]):
        order = torch.randperm(n, generator=g).to(x.device)  # one copy per epoch, as privfedcal
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


def accuracy(model, x, y) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ---- the bare loop --------------------------------------------------------------------------
def role_bare(args) -> None:
    import torch

    torch.set_num_threads(1)
    data, parts = load(args.dataset, args.clients, args.alpha)
    device = torch.device(args.device)
    model = make_model(data, args.cnn).to(device)
    meter = make_meter(args, data)
    x_all, y_all = data.x_train.to(device), data.y_train.to(device)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    acc = 0.0
    for r in range(1, args.rounds + 1):
        states, weights = [], []
        for c, idx in enumerate(parts):
            idx_t = torch.as_tensor(idx, device=device)
            x, y = x_all[idx_t], y_all[idx_t]
            model.load_state_dict(global_state)
            if args.client_eval == "bare":  # extra work that --count must catch
                accuracy(model, x, y)
            local_train(model, x, y, 1000 * r + c)
            if args.client_eval == "bare":
                accuracy(model, x, y)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
            weights.append(len(idx))
        total = sum(weights)
        global_state = {k: sum(s[k] * (w / total) for s, w in zip(states, weights, strict=True))
                        for k in global_state}
        model.load_state_dict(global_state)
        acc = accuracy(model, x_test, y_test)
        meter.tick(r)
    print(json.dumps({"accuracy": acc}))


# ---- Flower's simulation engine ---------------------------------------------------------------
def flower_client_app(args):
    """The ClientApp: the bare loop's training; with ``--count`` its work, counted in the
    actor's process, travels back in the reply's metrics."""
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    client_app = ClientApp()
    cache: dict = {}

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        if "data" not in cache:  # one Ray actor serves many virtual nodes: load once
            cache["data"] = load(args.dataset, args.clients, args.alpha)
            cache["meter"] = make_meter(args, cache["data"][0])
        (data, parts), meter = cache["data"], cache["meter"]
        c = int(context.node_config["partition-id"])
        idx = torch.as_tensor(parts[c])
        model = make_model(data, args.cnn)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        before = dict(meter.totals)
        r = int(msg.content["config"]["server-round"])
        loss = local_train(model, data.x_train[idx], data.y_train[idx], 1000 * r + c)
        metrics = {"train-loss": loss, "num-examples": len(idx)}
        if args.count:
            metrics.update({f"count-{k}": v - before[k] for k, v in meter.totals.items()})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    return client_app


def flower_strategy(args, meter: Meter):
    from flwr.app import MetricRecord
    from flwr.serverapp.strategy import FedAvg

    def add_counts(replies, weighting_key: str) -> MetricRecord:
        for reply in replies:  # the clients' counted work joins the server's
            m = reply["metrics"]
            meter.add({k[len("count-"):]: m[k] for k in m if k.startswith("count-")})
        return MetricRecord({})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                      min_train_nodes=args.clients, min_available_nodes=args.clients,
                      train_metrics_aggr_fn=add_counts if args.count else None)
    if args.dp:
        from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

        strategy = DifferentialPrivacyServerSideFixedClipping(
            strategy, noise_multiplier=args.noise_multiplier, clipping_norm=args.clip,
            num_sampled_clients=args.clients)
    return strategy


def role_flower(args) -> None:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    torch.set_num_threads(1)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        data, _ = load(args.dataset, args.clients, args.alpha)
        model = make_model(data, args.cnn)
        meter = make_meter(args, data)

        def central(round_: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            acc = accuracy(model, data.x_test, data.y_test)
            if round_ > 0:  # round 0 is the initial model's evaluation, before any round
                meter.tick(round_)
            return MetricRecord({"accuracy": acc})

        result = flower_strategy(args, meter).start(
            grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=args.rounds,
            train_config=ConfigRecord({}), evaluate_fn=central)
        metrics = result.evaluate_metrics_serverapp
        print(json.dumps({"accuracy": metrics[max(metrics)]["accuracy"]}), flush=True)

    run_simulation(server_app=server_app, client_app=flower_client_app(args),
                   num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})


# ---- privfedcal, counted --------------------------------------------------------------------
def role_privfedcal(args) -> None:
    """``privfedcal train`` in this process with its work counted (``--count`` only; timed
    runs start the command itself): the tick is written where its progress line is made."""
    import privfedcal.cli.run_progress as run_progress
    from privfedcal.cli.main import main as privfedcal_main
    from privfedcal.data.datasets import load_dataset

    data = load_dataset(args.dataset)
    meter = make_meter(args, data)
    line = run_progress.progress_line
    if args.client_batch > 1:  # vmap hides the steps from module hooks: count its plan
        import privfedcal.federation.vectorised as vectorised

        plan_steps = vectorised.plan_steps

        def counted_plan(jobs, spec, round_):
            order, plan = plan_steps(jobs, spec, round_)
            meter.count_plan(plan.steps, int(plan.weight.sum()))
            return order, plan

        meter.plan_counted = True
        vectorised.plan_steps = counted_plan

    # The MLP's hand-written steps (federation/chain_steps.py) call no module, so the hook
    # sees none of them: each is counted where it runs. The meter's own hook is not one that
    # would send them back to autograd.
    from torch.nn.modules import module as module_globals

    import privfedcal.federation.chain_steps as chain_steps

    hand_step, observed = chain_steps.ChainSteps.step, chain_steps._observed

    def counted_step(self, x, y):
        meter.count_plan([1], int(x.shape[0]))
        return hand_step(self, x, y)

    def observed_but_by_the_meter(model):
        hooks = module_globals._global_forward_hooks
        mine = {k: f for k, f in hooks.items() if getattr(f, "__self__", None) is meter}
        for k in mine:
            del hooks[k]
        try:
            return observed(model)
        finally:
            hooks.update(mine)

    chain_steps.ChainSteps.step = counted_step
    chain_steps._observed = observed_but_by_the_meter

    def counted_line(rec, total):
        meter.tick(rec["round"])
        return line(rec, total)

    run_progress.progress_line = counted_line
    privfedcal_main(privfedcal_argv(args, Path(args.out)))


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


def pfl_net(data, cnn: bool):
    """The same network, with the loss and metrics pfl's ``PyTorchModel`` calls."""
    import torch
    import torch.nn.functional as F
    from pfl.metrics import Weighted

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(data, cnn)

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

    return Net()


def pfl_postprocessors(args) -> list:
    """Weighting by data points (FedAvg), or DP-FedAvg's weighting by user and central noise
    from pfl's RDP accountant."""
    from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser

    if not args.dp:
        return [WeightByDatapoints()]
    from pfl.privacy import (
        CentrallyAppliedPrivacyMechanism,
        GaussianMechanism,
        RDPPrivacyAccountant,
    )

    accountant = RDPPrivacyAccountant(num_compositions=args.rounds, sampling_probability=1.0,
                                      mechanism="gaussian", epsilon=args.epsilon,
                                      delta=args.delta)
    return [WeightByUser(), CentrallyAppliedPrivacyMechanism(
        GaussianMechanism.from_privacy_accountant(accountant, args.clip))]


def pfl_parts(args):
    """(network data, users' tensors, the test set) from the exported ``.npz``."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    npz = np.load(args.data)
    data = SimpleNamespace(num_classes=int(npz["num_classes"]),
                           in_channels=int(npz["in_channels"]),
                           image_size=int(npz["image_size"]))
    x_train, y_train = torch.from_numpy(npz["x_train"]), torch.from_numpy(npz["y_train"])
    offsets, order = npz["offsets"], npz["order"]
    users = {c: [x_train[order[offsets[c]:offsets[c + 1]]],
                 y_train[order[offsets[c]:offsets[c + 1]]]] for c in range(args.clients)}
    test = (torch.from_numpy(npz["x_test"]), torch.from_numpy(npz["y_test"]))
    return data, users, test


def role_pfl(args) -> None:
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(1)
    data, users, test = pfl_parts(args)
    net = pfl_net(data, args.cnn)
    meter = make_meter(args, data)
    model = PyTorchModel(
        net, local_optimizer_create=lambda params, lr: torch.optim.SGD(
            params, lr=lr, momentum=LOCAL["momentum"], weight_decay=LOCAL["weight_decay"]),
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    train = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse",
                                                                 list(users)))
    backend = SimulatedBackend(training_data=train, val_data=None,
                               postprocessors=pfl_postprocessors(args))
    eval_params = NNEvalHyperParams(local_batch_size=1024)

    class Clock(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            meter.tick(central_iteration + 1)
            return False, Metrics()

    # evaluation_frequency: the clients' own data evaluated before and after local training
    # in iterations divisible by it. No other way does that work, so it is set to the number
    # of rounds: iteration 0 only (pfl always evaluates there), the round no way times.
    client_eval = 1 if args.client_eval == "pfl" else args.rounds
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds,
                                           evaluation_frequency=client_eval,
                                           train_cohort_size=args.clients, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=LOCAL["local_epochs"],
                                              local_learning_rate=LOCAL["lr"],
                                              local_batch_size=LOCAL["batch_size"]),
        model_eval_params=eval_params,
        callbacks=[CentralEvaluationCallback(Dataset(test), eval_params, frequency=1), Clock()],
        send_metrics_to_platform=False)
    with torch.no_grad():
        net.eval()
        device = next(net.parameters()).device
        acc = float((net(test[0].to(device)).argmax(1).cpu() == test[1]).float().mean())
    print(json.dumps({"accuracy": acc}), flush=True)


# ---- the driver ---------------------------------------------------------------------------
def privfedcal_argv(args, out: Path) -> list[str]:
    """``privfedcal train``'s arguments for this workload: the defaults otherwise."""
    argv = ["train", "--rounds", str(args.rounds), "--clients", str(args.clients), "--alpha",
            str(args.alpha), "--dataset", args.dataset, "--threads", "1", "--device", args.device,
            "--local-epochs", str(LOCAL["local_epochs"]), "--batch-size",
            str(LOCAL["batch_size"]), "--lr", str(LOCAL["lr"]), "--momentum",
            str(LOCAL["momentum"]), "--weight-decay", str(LOCAL["weight_decay"]),
            "--data-seed", "0", "--out", str(out)]
    # --data-seed 0: the partition every other way trains on (under a protection privfedcal
    # otherwise draws a secret partition seed, a different split in every run)
    argv += ["--model", "cnn", "--no-augment"] if args.cnn else ["--model", "mlp"]
    if args.client_batch > 1:
        argv += ["--client-batch", str(args.client_batch)]
    if args.dp:
        argv += ["--dp-updates", "--dp-eps", str(args.epsilon), "--dp-delta",
                 str(args.delta), "--dp-update-clip", str(args.clip)]
    return argv


def way_command(way: str, args, tmp: Path, out: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    role = [__file__, "--role", way, "--rounds", str(args.rounds), "--clients",
            str(args.clients), "--alpha", str(args.alpha), "--dataset", args.dataset]
    role += (["--cnn"] if args.cnn else []) + (["--count"] if args.count else [])
    role += ["--client-eval", args.client_eval] if args.client_eval else []
    role += ["--device", args.device, "--client-batch", str(args.client_batch)]
    if args.dp:
        role += ["--dp", "--epsilon", str(args.epsilon), "--delta", str(args.delta),
                 "--clip", str(args.clip), "--noise-multiplier", str(args.noise_multiplier)]
    if way == "privfedcal" and not args.count:  # the command itself, as users run it
        return [sys.executable, "-m", "privfedcal.cli.main", *privfedcal_argv(args, out)], env
    if way == "privfedcal":
        return [sys.executable, *role, "--out", str(out)], env
    if way == "pfl":
        env.pop("PYTHONPATH")  # pfl's environment need not have privfedcal
        env["PFL_PYTORCH_DEVICE"] = args.device
        return [args.pfl_python, *role, "--data", str(tmp / "peer-data.npz")], env
    return [sys.executable, *role], env


def read_lines(stream, lines: list[tuple[float, str]]) -> None:
    """Every line of ``stream`` with the time it arrived."""
    for line in stream:
        lines.append((time.perf_counter(), line.rstrip("\n")))


def round_ticks(lines: list[tuple[float, str]]) -> list[tuple[float, dict]]:
    """The end-of-round lines: ``peer_meter``'s, else privfedcal's own progress lines."""
    ticks = [(t, json.loads(x[len(TICK) + 1:])) for t, x in lines if x.startswith(TICK + " ")]
    if ticks:
        return ticks
    return [(t, {"round": int(m.group(1))}) for t, x in lines
            if (m := PRIVFEDCAL_ROUND.match(x))]


def run_way(way: str, args, tmp: Path, repeat: int) -> dict:
    """One whole process of ``way``: its wall and CPU time, its rounds as stamped here, its
    accuracy and (``--count``) its per-round work."""
    out = tmp / f"pfc{repeat}"
    cmd, env = way_command(way, args, tmp, out)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp)
    err: list[tuple[float, str]] = []
    std: list[tuple[float, str]] = []
    readers = [threading.Thread(target=read_lines, args=(proc.stderr, err), daemon=True),
               threading.Thread(target=read_lines, args=(proc.stdout, std), daemon=True)]
    for r in readers:
        r.start()
    code = proc.wait()
    wall = time.perf_counter() - t0
    for r in readers:
        r.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        tail = "\n".join(x for _, x in err[-40:])
        raise SystemExit(f"{way} failed ({code}):\n{tail}")
    ticks = round_ticks(err)
    seconds = [b - a for (a, _), (b, _) in zip(ticks, ticks[1:], strict=False)]
    result = {"way": way, "wall": wall, "round": statistics.median(seconds),
              "round_seconds": seconds,
              "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}
    if args.count:
        result["work"] = round_work([t for _, t in ticks])
    if way == "privfedcal":
        summary = json.loads((out / "summary.json").read_text())
        result["accuracy"] = summary["accuracy"]
        if args.dp:
            result["noise_multiplier"] = summary["privacy"]["user_dp"].get("noise_multiplier")
    else:
        result["accuracy"] = json.loads([x for _, x in std if x.startswith("{")][-1])["accuracy"]
    return result


def noise_multiplier(args) -> float:
    """The multiplier every DP way uses: opacus' RDP accountant, q = 1, ``rounds`` steps."""
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(target_epsilon=args.epsilon, target_delta=args.delta,
                                sample_rate=1.0, steps=args.rounds, accountant="rdp",
                                epsilon_tolerance=0.001)


def workloads(args) -> list[tuple[str, argparse.Namespace, list[str]]]:
    """(name, arguments, ways) of each workload: the one the flags describe, or with
    ``--table`` every row of the peers table."""
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not args.table:
        return [("cnn" if args.cnn_images else "dp" if args.dp else "fedavg", args, ways)]
    fedavg = copy.copy(args)
    fedavg.dp, fedavg.cnn_images = False, 0
    dp = copy.copy(fedavg)
    dp.dp, dp.epsilon, dp.clip = True, 8.0, 0.05
    found = [("fedavg", fedavg, ways), ("dp", dp, ways)]
    if args.cnn_images:
        cnn = copy.copy(fedavg)
        cnn.cnn_images, cnn.rounds = args.cnn_images, args.cnn_rounds
        found.append(("cnn", cnn, ways))
    return found


def prepare(args, ways: list[str], tmp: Path) -> list[str]:
    """Data, noise multiplier and the ways this workload runs (DP: no bare loop)."""
    if args.dp:
        ways = [w for w in ways if w != "bare"]
        args.noise_multiplier = noise_multiplier(args)
    if args.cnn_images > 0:
        from cifar_like import make_npz

        args.dataset = f"npz:{make_npz(tmp / 'cifar-shaped.npz', args.cnn_images)}"
        args.cnn = True
    if "pfl" in ways:
        export_data(args, tmp / "peer-data.npz")
    return ways


def run_pairs(args, ways: list[str], tmp: Path) -> dict:
    """``--repeats`` interleaved repeats, the order of the ways reversed every other one."""
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    load_before = os.getloadavg()
    for r in range(args.repeats):
        for w in (ways if r % 2 == 0 else ways[::-1]):
            runs[w].append(run_way(w, args, tmp, r))
    return {"runs": runs, "load_before": load_before, "load_after": os.getloadavg()}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarise(name: str, args, measured: dict) -> dict:
    """Per way: whole process (min, median), CPU, round, accuracy; per peer: the paired
    ratios peer / privfedcal, per round and whole process (median and range)."""
    runs = measured["runs"]
    rows = {}
    for w, rs in runs.items():
        rows[w] = {"whole": spread([r["wall"] for r in rs]), "round": spread(
            [r["round"] for r in rs]), "cpu": spread([r["cpu"] for r in rs]),
            "accuracy": statistics.median(r["accuracy"] for r in rs)}
        if w != "privfedcal" and "privfedcal" in runs:
            pairs = list(zip(runs["privfedcal"], rs, strict=True))
            rows[w]["ratio_round"] = spread([b["round"] / a["round"] for a, b in pairs])
            rows[w]["ratio_whole"] = spread([b["wall"] / a["wall"] for a, b in pairs])
    return {"workload": name, "describe": describe(args), "load_before":
            measured["load_before"], "load_after": measured["load_after"], "ways": rows,
            "runs": runs}


def describe(args) -> str:
    what = f"CNN, {args.cnn_images} CIFAR-shaped images" if args.cnn else "digits MLP"
    dp = (f"; user-level DP-FedAvg, epsilon {args.epsilon:g}, delta {args.delta:g}, clip "
          f"{args.clip:g}, noise multiplier {args.noise_multiplier:.3f} (RDP, q = 1)"
          if args.dp else "")
    runs = "work counted, one run per way" if args.count else f"{args.repeats} interleaved pairs"
    if args.client_batch > 1:
        runs += (f"; privfedcal with --client-batch {args.client_batch} (its vectorised "
                 "trainer, a privfedcal option)")
    return (f"FedAvg, {what}, {args.clients} clients (Dirichlet {args.alpha}), {args.rounds} "
            f"rounds, 2 local epochs, 1 thread, the test set evaluated every round; {runs}{dp}; "
            f"our choices: pfl's minimize_reuse sampler, Flower's FedAvg strategy")


def show(result: dict) -> None:
    def load(v) -> str:
        return ", ".join(f"{x:.1f}" for x in v)

    print(result["describe"])
    print(f"load average (1, 5, 15 min) before {load(result['load_before'])}; after "
          f"{load(result['load_after'])} ({os.cpu_count()} CPUs)")
    for w, row in result["ways"].items():
        line = (f"  {w:>10}: whole min {row['whole']['min']:7.2f} s median "
                f"{row['whole']['median']:7.2f} s  round median {row['round']['median']:.4f} s"
                f" (runs {row['round']['min']:.4f}-{row['round']['max']:.4f})  CPU median "
                f"{row['cpu']['median']:6.2f} s  accuracy {row['accuracy']:.4f}")
        print(line)
    for w, row in result["ways"].items():
        if "ratio_round" in row:
            rr, rw = row["ratio_round"], row["ratio_whole"]
            print(f"  {w} / privfedcal over {rr['n']} pairs: per round {rr['median']:.2f} "
                  f"({rr['min']:.2f}-{rr['max']:.2f}), whole process {rw['median']:.2f} "
                  f"({rw['min']:.2f}-{rw['max']:.2f})")


def table(results: list[dict]) -> None:
    """The peers table of docs/results/engine.md, as markdown."""
    print("| workload | way | whole process | round | accuracy | peer / privfedcal per round "
          "(median, range) | peer / privfedcal whole process |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        first = True
        for w, row in res["ways"].items():
            ratios = ("", "")
            if "ratio_round" in row:
                rr, rw = row["ratio_round"], row["ratio_whole"]
                ratios = (f"{rr['median']:.2f} ({rr['min']:.2f}-{rr['max']:.2f})",
                          f"{rw['median']:.2f} ({rw['min']:.2f}-{rw['max']:.2f})")
            print(f"| {res['workload'] if first else ''} | {w} | {row['whole']['median']:.2f} s "
                  f"| {row['round']['median']:.3f} s | {row['accuracy']:.4f} | {ratios[0]} "
                  f"| {ratios[1]} |")
            first = False


def count_work(args, ways: list[str], tmp: Path) -> dict:
    """Each way once, its work per timed round counted from inside the run."""
    work = {w: run_way(w, args, tmp, 0)["work"] for w in ways}
    for w, rounds in work.items():
        print(f"  {w:>10}: " + "; ".join(
            f"round {r['round']}: {r['steps']} steps, {r['train_samples']} training samples, "
            f"{r['eval_samples']} evaluation samples" for r in rounds[:3])
            + (" ..." if len(rounds) > 3 else ""))
    differences = work_differences(work)
    print("same work in every way" if not differences else
          "different work:\n  " + "\n  ".join(differences))
    return {"work": work, "differences": differences}


def arguments() -> argparse.ArgumentParser:
    ap = harness.parser(__doc__, repeats=7)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--cnn-images", type=int, default=0)
    ap.add_argument("--cnn-rounds", type=int, default=5, help="rounds of the CNN row (--table)")
    ap.add_argument("--ways", default="privfedcal,bare,pfl,flower")
    ap.add_argument("--pfl-python", default=None,
                    help="python of an environment with pfl[pytorch] 0.6.0 (way 'pfl'); "
                         "default: this one, if it imports pfl")
    ap.add_argument("--dp", action="store_true", help="user-level DP-FedAvg in every way")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=0.05)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: privfedcal, the bare loop "
                    "and pfl (gpu_round.py); Flower's ClientApps train on the CPU")
    ap.add_argument("--client-batch", type=int, default=1,
                    help="privfedcal's --client-batch: clients trained at once by its "
                         "vectorised trainer (1: one at a time, its default)")
    ap.add_argument("--table", action="store_true", help="every row of the peers table")
    ap.add_argument("--count", action="store_true",
                    help="count each way's work per round instead of timing it")
    ap.add_argument("--noise-multiplier", type=float, default=math.nan, help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=["privfedcal", "bare", "flower", "pfl"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--client-eval", choices=["bare", "pfl"], default=None,
                    help=argparse.SUPPRESS)  # extra work in one way, for the --count check
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dataset", default="digits", help=argparse.SUPPRESS)
    ap.add_argument("--cnn", action="store_true", help=argparse.SUPPRESS)
    return ap


def pfl_python(args) -> str | None:
    if args.pfl_python:
        return args.pfl_python
    import importlib.util

    return sys.executable if importlib.util.find_spec("pfl") is not None else None


def main() -> int:
    args = harness.parse(arguments())
    roles = {"privfedcal": role_privfedcal, "bare": role_bare, "flower": role_flower,
             "pfl": role_pfl}
    if args.role:
        roles[args.role](args)
        return 0
    args.pfl_python = pfl_python(args)
    if "pfl" in args.ways.split(",") and not args.pfl_python:
        print("peers: way pfl needs --pfl-python (a venv with pip install "
              "'pfl[pytorch]==0.6.0')", file=sys.stderr)
        return 2
    results, status = [], 0
    for name, w_args, ways in workloads(args):
        with tempfile.TemporaryDirectory() as tmp:
            ways = prepare(w_args, ways, Path(tmp))
            if args.count:
                print(describe(w_args))
                result = {"workload": name, **count_work(w_args, ways, Path(tmp))}
                status = max(status, 1 if result["differences"] else 0)
            else:
                result = summarise(name, w_args, run_pairs(w_args, ways, Path(tmp)))
                show(result)
        results.append(result)
    if args.table and not args.count:
        table(results)
    harness.finish(args, {"workloads": results})
    return status


if __name__ == "__main__":
    raise SystemExit(main())
