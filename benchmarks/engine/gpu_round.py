"""privfedcal's round on a GPU beside a bare GPU loop (and pfl-research where its PyTorch
backend imports), on the CIFAR-shaped CNN, under ``peers.py``'s rules: the same work per
round (10 clients, 2 local epochs of SGD, batch 32, the test set evaluated once per round, no
per-client evaluation), each round timed between the ends of consecutive rounds from
outside the process, privfedcal with its transcript and checkpoint on; pairs interleaved,
the order reversed every other pair. Then, if time is left, the full-budget CCVR row at
Dirichlet 0.1 from ``configs/ccvr-cifar10-a0.1.toml`` (needs CIFAR-10's
``cifar-10-batches-py`` under ``--cifar10-root``).

Made for a borrowed GPU with minutes to spend: ``--budget-s`` bounds the whole script (a run
is started only while its expected time fits), and every finished run appends one JSON line
to ``--out`` at once, so an interrupted script keeps what it measured. The full-budget run
gets what is left and is stopped with Ctrl-C's signal at the end: its run folder keeps the
checkpoint of its last round (``privfedcal train --resume DIR`` goes on), and its line says
how far it got.

Lines (``"kind"``): ``start`` (device, settings), ``run`` (one way's process: round median,
every timed round, whole-process wall, accuracy), ``skipped`` (a way or row not run, and
why), ``pairs`` (per peer: the paired per-round ratios peer / privfedcal, median and range),
``full-budget`` (rounds done, last accuracy, seconds, finished or stopped).

    python benchmarks/engine/gpu_round.py --out gpu-rows.jsonl [--device cuda] [--images 10000]
        [--rounds 10] [--pairs 3] [--budget-s 540] [--cifar10-root DIR] [--pfl-python PATH]
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import harness  # noqa: E402
import peers  # noqa: E402

CCVR_ROW = "configs/ccvr-cifar10-a0.1.toml"


def append(out: Path, line: dict) -> None:
    """One finished result, on disk before the next run starts."""
    with out.open("a") as f:
        f.write(json.dumps(harness._plain(line)) + "\n")
        f.flush()


def peer_args(args, tmp: Path):
    """``peers.py``'s arguments for the CNN workload on this device."""
    from cifar_like import make_npz

    ns = peers.arguments().parse_args([])
    ns.rounds, ns.clients, ns.alpha, ns.device = args.rounds, 10, 0.1, args.device
    ns.dataset = f"npz:{make_npz(tmp / 'cifar-shaped.npz', args.images)}"
    ns.cnn, ns.cnn_images, ns.dp, ns.count = True, args.images, False, False
    ns.pfl_python = peers.pfl_python(args)
    return ns


def imports_pfl(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import pfl.model.pytorch"],
                              capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def runnable_ways(ns, out: Path) -> list[str]:
    """privfedcal and the bare loop; pfl where its PyTorch backend imports."""
    if ns.pfl_python is None:
        append(out, {"kind": "skipped", "way": "pfl", "why": "pfl is not importable here "
                     "(--pfl-python names an interpreter with pfl[pytorch] 0.6.0)"})
    elif not imports_pfl(ns.pfl_python):
        append(out, {"kind": "skipped", "way": "pfl",
                     "why": f"pfl's PyTorch backend does not import in {ns.pfl_python}"})
    else:
        return ["privfedcal", "bare", "pfl"]
    return ["privfedcal", "bare"]


def measure_pairs(args, ns, ways: list[str], tmp: Path, out: Path, deadline: float) -> dict:
    """Interleaved pairs while the next run's expected time fits before ``deadline``."""
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    longest = 0.0
    for p in range(args.pairs):
        for w in (ways if p % 2 == 0 else ways[::-1]):
            if time.monotonic() + 1.5 * longest > deadline:
                append(out, {"kind": "skipped", "way": w, "pair": p, "why": "out of time"})
                return runs
            r = peers.run_way(w, ns, tmp, p)
            longest = max(longest, r["wall"])
            runs[w].append(r)
            append(out, {"kind": "run", "pair": p, **r})
    return runs


def paired(runs: dict[str, list[dict]]) -> dict:
    found = {}
    for w, rs in runs.items():
        pairs = list(zip(runs["privfedcal"], rs, strict=False))
        if w != "privfedcal" and pairs:
            found[w] = peers.spread([b["round"] / a["round"] for a, b in pairs])
    return found


def full_budget(args, out: Path, seconds: float) -> None:
    """The CCVR CIFAR-10 Dirichlet 0.1 row for at most ``seconds``, stopped as Ctrl-C would."""
    data = Path(args.cifar10_root or "") / "cifar-10-batches-py"
    if not args.cifar10_root or not data.is_dir():
        append(out, {"kind": "skipped", "row": CCVR_ROW,
                     "why": f"no CIFAR-10 at {data} (--cifar10-root DIR)"})
        return
    run_dir = Path(args.run_dir) / "ccvr-cifar10-a0.1"
    cmd = [sys.executable, "-m", "privfedcal.cli.main", "train", "--config",
           str(peers.ROOT / CCVR_ROW), "--data-root", args.cifar10_root, "--device",
           args.device, "--out", str(run_dir)]
    if (run_dir / "checkpoint").is_dir():  # an earlier call's stopped run goes on
        cmd = [sys.executable, "-m", "privfedcal.cli.main", "train", "--resume", str(run_dir)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the run keeps its last checkpoint
        code = proc.wait()
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text() if metrics.exists() else ""
    rows = [json.loads(x) for x in text.splitlines() if x]
    append(out, {"kind": "full-budget", "row": CCVR_ROW, "exit": code,
                 "finished": (run_dir / "summary.json").exists() and code == 0,
                 "rounds_done": len(rows), "last_accuracy": rows[-1]["accuracy"] if rows else None,
                 "seconds": time.monotonic() - t0, "run_dir": str(run_dir)})


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--cifar10-root", default=None)
    ap.add_argument("--run-dir", default="gpu-runs", help="folder of the full-budget run")
    ap.add_argument("--pfl-python", default=None)
    args = harness.parse(ap)
    deadline = time.monotonic() + args.budget_s
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ns = peer_args(args, Path(tmp))
        append(args.out, {"kind": "start", "machine": harness.machine(), "images": args.images,
                          "rounds": args.rounds, "pairs": args.pairs})
        ways = runnable_ways(ns, args.out)
        if "pfl" in ways:
            peers.export_data(ns, Path(tmp) / "peer-data.npz")
        runs = measure_pairs(args, ns, ways, Path(tmp), args.out, deadline)
    ratios = paired(runs)
    append(args.out, {"kind": "pairs", "ratios": ratios, "round_median": {
        w: statistics.median(r["round"] for r in rs) for w, rs in runs.items() if rs}})
    for w, s in ratios.items():
        print(f"{w} / privfedcal per round over {s['n']} pairs: {s['median']:.2f} "
              f"({s['min']:.2f}-{s['max']:.2f})")
    left = deadline - time.monotonic() - 10
    if left > 60:
        full_budget(args, args.out, left)
    else:
        append(args.out, {"kind": "skipped", "row": CCVR_ROW, "why": "out of time"})
    harness.finish(args, {"rows": str(args.out)})


if __name__ == "__main__":
    main()
