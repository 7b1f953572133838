"""How tight is ``privfedcal audit dp`` where the theory allows it?

One Gaussian release: CCVR's class statistics of one client, one round, the whole budget
epsilon on it, the worst-case canary (a feature outside the clip ball, clipped onto it),
audited through the real release code (``attacks/distinguishing/channels.py``) with the trials batched.
Prints, per epsilon: the claimed epsilon, the lower bound at 95%, the trials drawn (D and D'
together) and the seconds the game took (building the experiment excluded)::

    python benchmarks/privacy/dp_audit_tightness.py --trials 2000000

The CLI equivalent of one row: ``privfedcal audit dp --method ccvr --dp-eps 8 --clients 5
--rounds 1 --trials 2000000``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.attacks.distinguishing.channels import build_channels
from privfedcal.attacks.distinguishing.games import play
from privfedcal.settings.run_config import RunConfig


def main() -> None:
    p = harness.parser(__doc__, threads=1)
    p.add_argument("--trials", type=int, default=2_000_000, help="releases of each of D, D'")
    p.add_argument("--eps", default="1,2,4,8")
    a = harness.parse(p)
    rows = []
    torch.set_num_threads(a.threads)
    print("eps_claimed  eps_lower  lower/claimed  trials  seconds  (95%, ccvr-stats, 1 client, "
          "1 round)")
    for eps in (float(e) for e in a.eps.split(",")):
        cfg = RunConfig.of(dataset="digits", clients=5, method="ccvr", dp_eps=eps, rounds=1,
                        device="cpu", threads=a.threads, transcript=False, seed=0)
        (ch,) = build_channels(cfg, ("ccvr-stats",))
        t0 = time.perf_counter()
        row = play(ch, a.trials)
        secs = time.perf_counter() - t0
        print(f"{row['claimed_eps']:11.3f}  {row['eps_lower']:9.3f}  "
              f"{row['eps_lower'] / row['claimed_eps']:13.2f}  {row['trials']:,}  {secs:7.1f}")
        rows.append({**row, "seconds": secs})
    harness.finish(a, {"rows": rows})


if __name__ == "__main__":
    main()
