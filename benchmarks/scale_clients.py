"""Federation size: privfedcal with 1,000 and 10,000 clients at equal clients per round.

Data: a generated ``npz:`` set of 8x8 grayscale "images" (64 features, 10 classes, class
Gaussians), one ``users`` id per training sample, read with ``--partition natural``. User
sizes follow a power law (Pareto, shape 1.5, at least 5 samples, at most 500; median ~7,
mean ~14) with Dirichlet(0.5) label skew per user, so the 10,000-client set is ten times the
1,000-client one and a client's size has the same distribution in both: only the federation
size changes. The test set (2,000 samples) is the same.

Each configuration runs ``privfedcal train`` in a fresh process (MLP, 1 local epoch, one
thread, CPU, ``--min-size 5``) and reports

- per-round wall time (median of the rounds' ``seconds`` in ``metrics.jsonl``) and the
  samples the round's clients hold (clients are drawn from a long tail: two draws of 100
  clients differ in work, so compare seconds per 1,000 samples too);
- peak RSS of the child (``ru_maxrss``);
- set-up time: process start to the first round's client selection (and the part of it
  after torch and the engine are imported: data, partition, run folder);
- the calibration's seconds from ``summary.json`` (the CKKS time is the difference between
  a ``--secagg`` run and the same run in the clear);
- bytes per client: model-update bytes per participant-round, calibration bytes per client;
- sizes of the run folder, ``clients.jsonl`` and ``server/transcript`` (and its file count).

    python benchmarks/scale_clients.py [--sizes 1000,10000] [--per-round 100,500]
        [--protect clear,secagg,dp] [--calibrate ccvr] [--rounds 3] [--timeout 180]
        [--no-transcript]

``--protect``: ``clear``, ``secagg`` (``--secagg``: CKKS sums of the calibration uploads)
and ``dp`` (``--dp-eps 8``). ``--calibrate none`` runs FedAvg alone (the rounds only);
``ccvr`` adds CCVR after the last round, whose release asks every client of the federation.
A configuration that runs past ``--timeout`` seconds is stopped and reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

#: the child: times the first round's client selection from process start, then prints its
#: peak RSS; the CLI runs as ``privfedcal train``
CHILD = """import time
T0 = time.time()
import json, resource, runpy, sys
from privfedcal.federation import simulator as S
T1 = time.time()  # torch and the engine imported
first = []
select = S.Simulator.select_clients
def timed(self, round_):
    if not first:
        first.append(time.time())
    return select(self, round_)
S.Simulator.select_clients = timed
sys.argv = ['privfedcal'] + sys.argv[1:]
try:
    runpy.run_module('privfedcal.cli.main', run_name='__main__')
except SystemExit as e:
    assert not e.code, e.code
print('BENCH', json.dumps({'peak_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                           'setup_s': first[0] - T0 if first else None,
                           'setup_after_imports_s': first[0] - T1 if first else None,
                           'process_s': time.time() - T0}))
"""


def make_npz(path: Path, users: int, seed: int = 0) -> tuple[Path, np.ndarray]:
    """``users`` power-law users of 8x8 uint8 class-Gaussian samples; returns the path and
    the users' sizes."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(500, np.floor(5 * (1 + rng.pareto(1.5, size=users)))).astype(int)
    n = int(sizes.sum())
    uid = np.repeat(np.arange(users), sizes)
    cum = rng.dirichlet(np.full(10, 0.5), size=users).cumsum(1)[uid]
    y = (rng.random(n)[:, None] > cum).sum(1).clip(0, 9)
    means = np.random.default_rng(123).normal(0, 1, size=(10, 64))  # same classes everywhere

    def pixels(labels: np.ndarray, r: np.random.Generator) -> np.ndarray:
        f = means[labels] + r.normal(0, 1, size=(len(labels), 64))
        return np.clip(np.round(128 + 40 * f), 0, 255).astype(np.uint8).reshape(-1, 8, 8)

    y_test = np.random.default_rng(7).integers(0, 10, 2000)
    np.savez(path, x_train=pixels(y, rng), y_train=y, users=uid,
             x_test=pixels(y_test, np.random.default_rng(8)), y_test=y_test)
    return path, sizes


def tree_bytes(path: Path) -> tuple[int, int]:
    """(bytes, files) under ``path`` (0, 0 when absent)."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(root, name))
            files += 1
    return total, files


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


PROTECT = {"clear": [], "secagg": ["--secagg"], "dp": ["--dp-eps", "8"]}


def run_one(npz: Path, sizes: np.ndarray, clients: int, per_round: int, protect: str,
            args: argparse.Namespace, out: Path) -> dict:
    method = "ccvr" if args.calibrate == "ccvr" else "fedavg"
    cmd = ["train", "--dataset", f"npz:{npz}", "--partition", "natural", "--clients",
           str(clients), "--min-size", "5", "--participation", repr(per_round / clients),
           "--rounds", str(args.rounds), "--local-epochs", "1", "--model", "mlp",
           "--method", method, "--threads", "1", "--device", "cpu", "--out", str(out), "-q",
           *PROTECT[protect], *(["--no-transcript"] if args.no_transcript else [])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    row = {"clients": clients, "per_round": per_round, "protect": protect,
           "command": "privfedcal " + " ".join(cmd)}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, *cmd], capture_output=True,
                              text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        row["error"] = f"stopped after {args.timeout} s"
        return row
    if done.returncode != 0:
        row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        return row
    row.update(json.loads([x for x in done.stdout.splitlines() if x.startswith("BENCH")][-1][6:]))
    summary = json.loads((out / "summary.json").read_text())
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rounds]
    sampled = [json.loads(x)["sampled"] for x in (out / "clients.jsonl").read_text().splitlines()]
    held = [int(sizes[s].sum()) for s in sampled]
    row.update(round_s=statistics.median(seconds), round_s_all=seconds,
               s_per_1k_samples=statistics.median(1000 * t / h for t, h in zip(seconds, held, strict=True)),
               samples_per_round=statistics.median(held),
               calibration_s=(summary.get("calibration") or {}).get("seconds"),
               update_bytes_per_client=summary["model_update_bytes"] / max(1, sum(map(len, sampled))),
               calibration_bytes_per_client=summary.get("calibration_upload_bytes", 0) / clients,
               accuracy=summary.get("accuracy"),
               summary_bytes=(out / "summary.json").stat().st_size,
               clients_jsonl_bytes=(out / "clients.jsonl").stat().st_size)
    row["folder_bytes"], _ = tree_bytes(out)
    row["transcript_bytes"], row["transcript_files"] = tree_bytes(out / "server" / "transcript")
    return row


def describe(r: dict) -> str:
    head = f"{r['clients']:>6} clients, {r['per_round']:>3}/round, {r['protect']:<6}"
    if "error" in r:
        return f"{head}: {r['error']}"
    cal = f", calibration {r['calibration_s']:.1f} s" if r["calibration_s"] is not None else ""
    return (f"{head}: round {r['round_s']:.2f} s ({r['s_per_1k_samples']:.3f} s per 1,000 "
            f"samples, {r['samples_per_round']:.0f} samples), peak {r['peak_kib'] / 1024:.0f} MiB, "
            f"set-up {r['setup_s']:.1f} s ({r['setup_after_imports_s']:.1f} s after importing "
            f"torch){cal}, process {r['process_s']:.1f} s; bytes per "
            f"client: update {r['update_bytes_per_client']:,.0f}, calibration "
            f"{r['calibration_bytes_per_client']:,.0f}; folder {mib(r['folder_bytes'])}, "
            f"clients.jsonl {mib(r['clients_jsonl_bytes'])}, transcript "
            f"{mib(r['transcript_bytes'])} in {r['transcript_files']} files, summary.json "
            f"{mib(r['summary_bytes'])}; accuracy {r['accuracy']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--per-round", default="100,500")
    ap.add_argument("--protect", default="clear,secagg,dp")
    ap.add_argument("--calibrate", choices=("ccvr", "none"), default="ccvr")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--no-transcript", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args()
    protects = args.protect.split(",")
    if unknown := set(protects) - set(PROTECT):
        raise SystemExit(f"--protect: unknown {sorted(unknown)}; choose from {sorted(PROTECT)}")
    rows = []
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        for k in map(int, args.sizes.split(",")):
            t0 = time.perf_counter()
            npz, sizes = make_npz(tmp_path / f"users-{k}.npz", k)
            print(f"{k} users: {int(sizes.sum())} samples, sizes "
                  f"min {sizes.min()} median {np.median(sizes):.0f} mean {sizes.mean():.1f} "
                  f"max {sizes.max()} (generated in {time.perf_counter() - t0:.1f} s)", flush=True)
            for per_round in map(int, args.per_round.split(",")):
                for protect in protects:
                    out = tmp_path / f"run-{k}-{per_round}-{protect}"
                    row = run_one(npz, sizes, k, per_round, protect, args, out)
                    with open("/proc/loadavg") as f:
                        row["load"] = " ".join(f.read().split()[:3])
                    rows.append(row)
                    print(describe(row) + f" [load {row['load']}]", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
