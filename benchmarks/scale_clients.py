"""Federation size: privfedcal with 1,000 and 10,000 clients at equal clients per round.

Data: a generated ``npz:`` set of 8x8 grayscale "images" (64 features, 10 classes, class
Gaussians), one ``users`` id per training sample, read with ``--partition natural``. User
sizes follow a power law (Pareto, shape 1.5, at least 5 samples, at most 500; median ~7,
mean ~14) with Dirichlet(0.5) label skew per user, so the 10,000-client set is ten times the
1,000-client one and a client's size has the same distribution in both: only the federation
size changes. The test set (2,000 samples) is the same.

Each configuration runs ``privfedcal train`` in a fresh process (MLP, 1 local epoch, one
thread, CPU, ``--min-size 5``) and reports

- per-round wall time (median of the rounds' ``seconds`` in ``metrics.jsonl``), the
  process's CPU time per round (rounds' CPU seconds / rounds: less sensitive than wall time
  to other processes on the machine, since the run uses one thread), and the
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

Each configuration runs once (a 10,000-client run takes the better part of an hour); the
per-round figures are medians over its rounds. ``--json PATH`` writes the benchmarks' common
record (``harness.py``): the arguments, the machine line and ``results.rows``, one row per
configuration with the numbers printed (``round_s_all``: every round's seconds).

``--protect``: ``clear``, ``secagg`` (``--secagg``: CKKS sums of the calibration uploads),
``dp`` (``--dp-eps 8`` on the calibration uploads), and for the rounds ``secagg-updates``
(``--secagg-updates``: CKKS sums of the model updates) and ``dp-updates`` (``--dp-eps 8
--dp-updates``: user-level DP-FedAvg). ``--calibrate none`` runs FedAvg alone (the rounds only);
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: harness
import harness  # noqa: E402

#: the child: times the first round's client selection from process start, then prints its
#: peak RSS; the CLI runs as ``privfedcal train``
CHILD = """import time
T0 = time.time()
import json, resource, runpy, sys
from privfedcal.federation import simulator as S
T1 = time.time()  # torch and the engine imported
first, last = [], []
select, finish = S.Simulator.select_clients, S.Simulator.finish
def timed(self, round_):
    if not first:
        first.append((time.time(), time.process_time()))
    return select(self, round_)
def finished(self):
    last.append((time.time(), time.process_time()))
    return finish(self)
S.Simulator.select_clients, S.Simulator.finish = timed, finished
sys.argv = ['privfedcal'] + sys.argv[1:]
try:
    runpy.run_module('privfedcal.cli.main', run_name='__main__')
except SystemExit as e:
    assert not e.code, e.code
print('BENCH', json.dumps({'peak_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                           'setup_s': first[0][0] - T0,
                           'setup_after_imports_s': first[0][0] - T1,
                           'rounds_s': last[0][0] - first[0][0],
                           'rounds_cpu_s': last[0][1] - first[0][1],
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


PROTECT = {"clear": [], "secagg": ["--secagg"], "dp": ["--dp-eps", "8"],
           "secagg-updates": ["--secagg-updates"], "dp-updates": ["--dp-eps", "8", "--dp-updates"]}


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
               round_cpu_s=row["rounds_cpu_s"] / len(seconds),
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


def ckks_probe(examples: int, clients: int, d: int = 128, classes: int = 10,
               clip: float = 10.0) -> dict:
    """CKKS cost of CCVR's release per client, from two secure sums of 4 and 16 uploads of
    the MLP's shape (10 classes, 128 features), run through the uplink's encrypting wire as
    a ``--secagg`` run builds it (its bounds for ``examples`` and ``clients``): seconds per
    upload (seal, the server's check and add) as the slope, the release's fixed cost (keys,
    decryption) as the intercept, and the ciphertext bytes per upload."""
    import torch

    from privfedcal.calibration.stats import ClassStats
    from privfedcal.privacy.secagg_stage import CKKSSettings, EncryptStage
    from privfedcal.privacy.transcript import Transcript
    from privfedcal.privacy.uplink import Uplink

    n = float(examples)
    stage = CKKSSettings(bounds={"count": n, "holders": float(clients), "sum": clip * n,
                                "outer": clip * clip * n, "grad": n},
                        dp=None, clients=clients, hide_counts=False)
    g = torch.Generator().manual_seed(0)
    seconds, sizes = {}, []
    for k in (4, 16):
        uploads = []
        for c in range(k):
            z = torch.randn(8, d, generator=g).clamp(-3, 3)
            y = torch.randint(0, classes, (8,), generator=g)
            uploads.append((c, ClassStats.from_features(z, y, classes).to_payload()))
        tr = Transcript(None)
        t0 = time.perf_counter()
        Uplink([EncryptStage(stage)]).aggregate(uploads, round_=1, label="ccvr-stats",
                                                transcript=tr)
        seconds[k] = time.perf_counter() - t0
        sizes += [e["bytes"] for e in tr.entries if e["view"] == "ciphertext"]
    slope = (seconds[16] - seconds[4]) / 12
    return {"per_upload_s": slope, "fixed_s": seconds[4] - 4 * slope,
            "ciphertext_bytes": statistics.median(sizes)}


def describe(r: dict) -> str:
    head = f"{r['clients']:>6} clients, {r['per_round']:>3}/round, {r['protect']:<14}"
    if "error" in r:
        return f"{head}: {r['error']}"
    cal = f", calibration {r['calibration_s']:.1f} s" if r["calibration_s"] is not None else ""
    return (f"{head}: round {r['round_s']:.2f} s, CPU {r['round_cpu_s']:.2f} s ({r['s_per_1k_samples']:.3f} s per 1,000 "
            f"samples, {r['samples_per_round']:.0f} samples), peak {r['peak_kib'] / 1024:.0f} MiB, "
            f"set-up {r['setup_s']:.1f} s ({r['setup_after_imports_s']:.1f} s after importing "
            f"torch){cal}, process {r['process_s']:.1f} s; bytes per "
            f"client: update {r['update_bytes_per_client']:,.0f}, calibration "
            f"{r['calibration_bytes_per_client']:,.0f}; folder {mib(r['folder_bytes'])}, "
            f"clients.jsonl {mib(r['clients_jsonl_bytes'])}, transcript "
            f"{mib(r['transcript_bytes'])} in {r['transcript_files']} files, summary.json "
            f"{mib(r['summary_bytes'])}; accuracy {r['accuracy']}")


def load() -> str:
    """The 1, 5 and 15 minute load averages, as printed beside each configuration."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--per-round", default="100,500")
    ap.add_argument("--protect", default="clear,secagg,dp")
    ap.add_argument("--calibrate", choices=("ccvr", "none"), default="ccvr")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--no-transcript", action="store_true")
    ap.add_argument("--ckks-probe", action="store_true",
                    help="only time CKKS per CCVR upload (no runs)")
    args = harness.parse(ap)
    protects = args.protect.split(",")
    if unknown := set(protects) - set(PROTECT):
        raise SystemExit(f"--protect: unknown {sorted(unknown)}; choose from {sorted(PROTECT)}")
    if args.ckks_probe:
        probes = {}
        for k, examples in ((1000, 13956), (10000, 134962)):  # the generated sets' sizes
            p = probes[str(k)] = ckks_probe(examples, k)
            print(f"CKKS, CCVR upload (10 x 128 features), bounds of {k} clients: "
                  f"{p['per_upload_s']:.3f} s per upload, {p['fixed_s']:.2f} s per release, "
                  f"{p['ciphertext_bytes']:,.0f} ciphertext bytes per upload [load {load()}]",
                  flush=True)
        harness.finish(args, {"ckks_probe": probes})
        return
    rows = []
    print(f"load average at start: {load()}", flush=True)
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
                    row["load"] = load()
                    rows.append(row)
                    print(describe(row) + f" [load {row['load']}]", flush=True)
    harness.finish(args, {"rows": rows})


if __name__ == "__main__":
    main()
