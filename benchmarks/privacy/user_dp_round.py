"""The DP-FedAvg work of one round, apart from training: ``UserDP.receive_round`` on fixed
updates.

A stand-in trainer hands ``--clients`` fixed model states of the digits MLP's shape (64-256-
128-10, 50,826 floats) to ``UserDP.receive_round`` as a trained client's would arrive: each
update is taken (difference, norm, clip, the state the server's transcript records, the running
sum), then the server's noise, the new global state and the ledgers' and accountant's charge.
Central noise, clip 0.05 (every update clipped), one thread. Prints wall and CPU
milliseconds per round (min / median over ``--rounds`` after ``--warmup``); ``--transcript``
also writes the transcript's files into a temporary folder, as a run does.

    python benchmarks/privacy/user_dp_round.py [--clients 10] [--rounds 50] [--transcript]

To compare two versions of the code, run it alternately with ``PYTHONPATH`` naming each
checkout (``PYTHONPATH=/path/to/old python benchmarks/privacy/user_dp_round.py``): the CPU
minimum is the figure to read on a shared machine.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

from privfedcal.federation.local import LocalResult  # noqa: E402
from privfedcal.privacy.accounting import PrivacyAccountant  # noqa: E402
from privfedcal.privacy.dp_accounting import DPAccounting  # noqa: E402
from privfedcal.privacy.releases import USER_DP_RELEASE  # noqa: E402
from privfedcal.privacy.transcript import Transcript  # noqa: E402
from privfedcal.privacy.user_dp import UserDP  # noqa: E402

#: the digits MLP's state (``--model mlp``): what each client uploads
SHAPES = {"body.1.weight": (256, 64), "body.1.bias": (256,), "body.3.weight": (128, 256),
          "body.3.bias": (128,), "classifier.weight": (10, 128), "classifier.bias": (10,)}


class FixedTrainer:
    """Hands the same trained states every round, as ``Trainer.train`` hands real ones."""

    def __init__(self, states: list[dict[str, torch.Tensor]]) -> None:
        self.states = states

    def train(self, global_state, jobs, round_, consume=None):
        out = []
        for state in self.states:
            if consume is not None:
                consume(state)
                state = {}
            out.append(LocalResult(state, None, 0.0))
        return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--transcript", action="store_true", help="write the transcript's files")
    args = harness.parse(ap)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    glob = {k: 0.1 * torch.randn(s, generator=g) for k, s in SHAPES.items()}
    states = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in glob.items()}
              for _ in range(args.clients)]
    rounds = args.warmup + args.rounds
    stage = DPAccounting(target=1e9, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                    sigmas={USER_DP_RELEASE: 2.852}, rates={USER_DP_RELEASE: 1.0}, clip=1.0,
                    grad_clip=1.0, distributed=False, covers_updates=False,
                    planned=[{"name": USER_DP_RELEASE, "sample_rate": 1.0, "steps": rounds}])
    udp = UserDP(stage, 0.05, denominator=args.clients, distributed=False)
    trainer, selected = FixedTrainer(states), list(range(args.clients))
    with tempfile.TemporaryDirectory() as tmp:
        transcript = Transcript(Path(tmp) if args.transcript else None)
        wall, cpu = [], []
        for r in range(1, rounds + 1):
            t, c = time.perf_counter(), time.process_time()
            udp.receive_round(trainer, [None] * args.clients, glob, selected, r, transcript, {},
                              None)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        transcript.close()
    wall_ms = [1e3 * x for x in wall[args.warmup:]]
    cpu_ms = [1e3 * x for x in cpu[args.warmup:]]
    print(f"UserDP.receive_round, {args.clients} MLP updates per round"
          f"{', transcript written' if args.transcript else ''}: wall "
          f"{harness.min_median(wall_ms, 'ms', 2)}; CPU {harness.min_median(cpu_ms, 'ms', 2)}")
    harness.finish(args, {"wall_ms": harness.stats(wall_ms), "cpu_ms": harness.stats(cpu_ms)})


if __name__ == "__main__":
    main()
