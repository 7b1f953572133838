"""The one-run audit (``attacks/distinguishing/one_run.py``) of a whole run's calibration uploads: claimed
vs lower-bounded epsilon, correct and with each fault, for CCVR and CReFF (digits, 5 clients,
3 rounds, all 128 feature axes of canaries, 5% of them guessed)::

    python benchmarks/privacy/dp_audit_onerun.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness

from privfedcal.attacks.distinguishing.channels import Faults
from privfedcal.attacks.distinguishing.one_run import one_run
from privfedcal.settings.run_config import RunConfig


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--guesses", type=float, default=0.05)
    a = harness.parse(p)
    rows = []
    torch.set_num_threads(1)
    cases = [("correct", 1.0, Faults()), ("correct", 8.0, Faults()),
             ("noise x 0.25", 1.0, Faults(noise_scale=0.25)), ("clipping off", 1.0,
                                                                Faults(clip=False)),
             ("no DP", None, Faults())]
    print("method  release        claimed  eps_lower  canaries, guesses, right  seconds")
    for method in ("ccvr", "creff"):
        for name, eps, faults in cases:
            kw = {} if eps is None else {"dp_eps": eps}
            cfg = RunConfig.of(dataset="digits", clients=5, method=method, rounds=3, device="cpu",
                            threads=1, transcript=False, seed=0, **kw)
            r = one_run(cfg, guesses=a.guesses, faults=faults)
            print(f"{method:6}  {name:13} {r['claimed_eps']:8.3f}  {r['eps_lower']:9.3f}  "
                  f"{r['canary'].split(' (')[0]}, {r['test_trials']}, "
                  f"{r['test_trials'] - r['false_pos']}  {r['seconds']:.2f}")
            rows.append({"method": method, "release": name, **r})
    harness.finish(a, {"rows": rows})


if __name__ == "__main__":
    main()
