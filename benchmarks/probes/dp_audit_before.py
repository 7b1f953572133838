"""``privfedcal audit dp`` on an older checkout's release code and on this one.

The audit's own modules (``attacks/distinguishing/games.py``, ``attacks/distinguishing/channels.py``,
``privacy/empirical.py``) are laid over a copy of the older checkout's package, so the games,
canaries and bounds are the same and only the release code differs. Configurations: DP-SGD
local training (``fedavg --dp-train``, one round of one client, 18 clients on digits) and
the CCVR and CReFF uploads (5 clients, 2 rounds), all at epsilon 1::

    python benchmarks/probes/dp_audit_before.py --before /path/to/checkout-at-d41de29
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
OVERLAY = ("attacks/distinguishing/games.py", "attacks/distinguishing/channels.py", "privacy/empirical.py")
CONFIGS = {
    "dp-sgd": dict(dataset="digits", clients=18, method="fedavg", dp_eps=1.0, dp_train=True,
                   rounds=1, batch_size=32),
    "ccvr-stats": dict(dataset="digits", clients=5, method="ccvr", dp_eps=1.0, rounds=2),
    "creff-grad": dict(dataset="digits", clients=5, method="creff", dp_eps=1.0, rounds=2),
}


def collect(trials: dict[str, int]) -> list[dict]:
    import torch

    from privfedcal.attacks.distinguishing.channels import build_channels
    from privfedcal.attacks.distinguishing.games import play
    from privfedcal.settings.run_config import RunConfig

    torch.set_num_threads(1)
    rows = []
    for name, kw in CONFIGS.items():
        cfg = RunConfig.of(**kw, device="cpu", threads=1, transcript=False, seed=0)
        (ch,) = build_channels(cfg, (name,))
        rows.append(play(ch, trials[name]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="an older checkout, e.g. one at d41de29")
    p.add_argument("--dpsgd-trials", type=int, default=300)
    p.add_argument("--trials", type=int, default=1_000_000, help="for the payload channels")
    p.add_argument("--collect", help=argparse.SUPPRESS)  # internal: rows to this file
    a = p.parse_args()
    trials = {"dp-sgd": a.dpsgd_trials, "ccvr-stats": a.trials, "creff-grad": a.trials}
    if a.collect:
        Path(a.collect).write_text(json.dumps(collect(trials)))
        return
    runs = [("before", Path(a.before))] if a.before else []
    runs.append(("after", HERE))
    for label, root in runs:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            shutil.copytree(root / "privfedcal", tree / "privfedcal")
            for rel in OVERLAY:
                shutil.copy(HERE / "privfedcal" / rel, tree / "privfedcal" / rel)
            out = Path(tmp) / "rows.json"
            subprocess.run([sys.executable, __file__, "--collect", str(out),
                            "--dpsgd-trials", str(a.dpsgd_trials), "--trials", str(a.trials)],
                           env={**os.environ, "PYTHONPATH": str(tree)}, check=True, cwd=tmp)
            for r in json.loads(out.read_text()):
                print(f"{label} {r['channel']}: claimed eps {r['claimed_eps']:.3f}, eps_lower "
                      f"{r['eps_lower']:.3f} at 95% ({r['false_pos']} false pos, "
                      f"{r['false_neg']} false neg of {r['test_trials']:,} counted trials, "
                      f"{r['trials']:,} in all; score {r['score']}; {r['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
