"""Where privfedcal's round goes: ``privfedcal train`` on the digits MLP as ``peers.py`` runs it
(transcript and checkpoint on: the defaults), in this process, its round split by wall-clock
timers around the functions that do each part.

A round is timed as in ``peers.py``: from one round's progress line to the next (the first
round is not timed). Its parts, exclusive of each other (seconds per round, the mean over
the timed rounds, so that the parts add up to the round):

* local training steps: ``train_client`` less the copy of the trained state (with
  ``--client-batch K``, the vectorised trainer's ``_train_group``: K clients' steps at once,
  their states included);
* client state copy: ``clone_state`` of each trained client;
* transcript record: ``Transcript.record`` and ``Transcript.seal`` on the round's thread
  (each record added to the round's batch, the batch handed to the writer thread);
* aggregation: ``RunningAverage.add`` / ``result`` (the weighted running sum);
* DP update clip (``--dp``): each update flattened, checked and clipped as it arrives
  (``dp_fedavg_round._RoundUploads.take``);
* journaled releases: ``ReleaseJournal.once`` (a DP release written and fsynced before it
  leaves: DP-FedAvg's noised sum; its wait for a checkpoint still being written included);
* evaluation: ``Simulator.evaluate`` on the test set;
* transcript wait: the round's thread waiting for the writer thread: ``Transcript.flush``
  inside ``Simulator.save`` where the round's thread writes the checkpoint itself (the
  pending files, then the index's new entries), else ``Simulator.wait_for_checkpoint`` (a
  DP release waiting for the checkpoint still being written);
* checkpoint: the rest of ``Simulator.save``: the checkpoint's snapshot handed over to the
  writer thread (``Transcript.hand_over``), or where the round's thread writes it, the
  calibrator's state, the safetensors file and its atomic swap;
* logs: ``RunLogger.round`` (metrics.csv, clients.jsonl);
* metrics record: the rest of ``keep_round`` (metrics.jsonl, the history);
* progress line: the CLI's per-round line on stderr;
* other: the rest of the round (client selection, the uplink's bookkeeping, the server
  update, the divergence checks, Python between them).

Beside each part's wall time, the main thread's CPU time in it (``time.thread_time``): the
work itself, which a busy machine stretches less than the wall time.

The writer thread's own time (``write_records``: the transcript's files; where it writes
them, the index's new entries and the checkpoint, ``write_checkpoint``; wall and CPU) runs
beside the round and is printed apart; on a machine with a spare core it is off the
critical path, on a busy one it competes with the round. ``--cprofile N`` also prints the N
functions with the most own time under cProfile (main thread only, in a second run: the
profiler's overhead would distort the split).

    python benchmarks/engine/round_profile.py [--rounds 20] [--repeats 3] [--dp]
        [--client-batch K]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import harness  # noqa: E402

PARTS = ("local training steps", "client state copy", "transcript record", "aggregation",
         "DP update clip", "journaled releases", "evaluation", "transcript wait", "checkpoint", "logs", "metrics record",
         "progress line", "other")


class Split:
    """Inclusive wall time per instrumented function, per round; the round's ends."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.rounds: list[dict[str, float]] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # the main thread's CPU time at each end
        self.writer = {"wall": 0.0, "cpu": 0.0}

    def wrap(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)
        split = self

        def timed(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                split.current[key] += time.perf_counter() - t
                split.current[f"{key} cpu"] += time.thread_time() - c

        setattr(owner, name, timed)

    def wrap_writer(self, owner, name: str) -> None:
        """The transcript writer thread's jobs: wall and that thread's CPU."""
        original = getattr(owner, name)
        writer = self.writer

        def timed(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                writer["wall"] += time.perf_counter() - t
                writer["cpu"] += time.thread_time() - c

        setattr(owner, name, timed)

    def end_round(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self.ends:
            self.rounds.append({**self.current, "round": now - self.ends[-1],
                                "round cpu": cpu - self.cpu_ends[-1],
                                "writer wall": self.writer["wall"],
                                "writer cpu": self.writer["cpu"]})
        self.ends.append(now)
        self.cpu_ends.append(cpu)
        self.current = defaultdict(float)
        self.writer.update(wall=0.0, cpu=0.0)


def instrument(split: Split) -> None:
    """Timers around the functions of each part (module globals, looked up at call time)."""
    import privfedcal.cli.run_progress as run_progress
    import privfedcal.federation.local as local
    import privfedcal.federation.simulator as simulator
    import privfedcal.federation.vectorised as vectorised
    import privfedcal.federation.workers as workers
    import privfedcal.privacy.transcript as transcript
    from privfedcal.federation.aggregate import RunningAverage
    from privfedcal.federation.runlog import RunLogger

    split.wrap(workers, "train_client", "train_client")
    split.wrap(vectorised.VectorisedTrainer, "_train_group", "train_client")
    split.wrap(local, "clone_state", "clone_state")
    split.wrap(transcript.Transcript, "record", "record")
    split.wrap(RunningAverage, "add", "aggregate")
    split.wrap(RunningAverage, "result", "aggregate")
    split.wrap(simulator.Simulator, "evaluate", "evaluate")
    try:  # DP-FedAvg's round and the release journal, where the code has them
        import privfedcal.privacy.dp_fedavg_round as dp_round
        from privfedcal.privacy.release_journal import ReleaseJournal

        split.wrap(dp_round._RoundUploads, "take", "dp clip")
        split.wrap(ReleaseJournal, "once", "journal")
    except ImportError:
        pass
    split.wrap(transcript.Transcript, "flush", "flush")
    split.wrap(simulator.Simulator, "save", "save")
    if hasattr(simulator, "write_checkpoint"):  # the checkpoint on the writer thread
        split.wrap(simulator.Simulator, "wait_for_checkpoint", "checkpoint wait")
        split.wrap_writer(simulator, "write_checkpoint")
        split.wrap_writer(transcript.Transcript, "_index_through")
    split.wrap(RunLogger, "round", "logs")
    split.wrap(simulator.Simulator, "keep_round", "keep_round")
    try:  # a batch of records per file
        import privfedcal.privacy.transcript_files as transcript_files

        split.wrap_writer(transcript_files, "write_records")
        split.wrap(transcript.Transcript, "seal", "record")
    except ImportError:  # a file per record (the code before the batches)
        split.wrap_writer(transcript, "save_file")
    line = run_progress.progress_line

    def ticking_line(rec, total):
        text = line(rec, total)
        split.end_round()  # the line is made just before it is printed
        return text

    run_progress.progress_line = ticking_line
    split.wrap(run_progress.Reporter, "line", "progress")


def exclusive(r: dict[str, float]) -> dict[str, float]:
    """One round's inclusive timers as the exclusive parts of PARTS."""
    g = r.get
    parts = {
        "local training steps": g("train_client", 0) - g("clone_state", 0),
        "client state copy": g("clone_state", 0), "transcript record": g("record", 0),
        "aggregation": g("aggregate", 0), "DP update clip": g("dp clip", 0),
        "journaled releases": g("journal", 0), "evaluation": g("evaluate", 0),
        "transcript wait": g("flush", 0) + g("checkpoint wait", 0),
        "checkpoint": g("save", 0) - g("flush", 0),
        "logs": g("logs", 0), "metrics record": g("keep_round", 0) - g("logs", 0) - g("save", 0),
        "progress line": g("progress", 0)}
    parts["other"] = r["round"] - sum(parts.values())
    return parts


def main_cpu(r: dict[str, float]) -> dict[str, float]:
    """A round's main-thread CPU timers under the names of its wall timers."""
    return {**{k[:-4]: v for k, v in r.items() if k.endswith(" cpu") and k != "round cpu"},
            "round": r["round cpu"]}


def run_once(args, profile: bool = False) -> list[dict[str, float]]:
    """One ``privfedcal train`` in this process, instrumented (or under cProfile)."""
    from peers import privfedcal_argv

    from privfedcal.cli.main import main as privfedcal_main

    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as quiet, \
            contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        argv = privfedcal_argv(args, Path(tmp) / "run")
        if not profile:
            privfedcal_main(argv)
            return []
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(privfedcal_main, argv)
        pstats.Stats(prof, stream=sys.__stdout__).sort_stats("tottime").print_stats(
            args.cprofile)
        return []


def main() -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--dp", action="store_true", help="user-level DP-FedAvg (epsilon 8, clip "
                                                      "0.05), as peers.py --dp")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--client-batch", type=int, default=1,
                    help="privfedcal's --client-batch (its vectorised trainer), as peers.py's")
    args = harness.parse(ap)
    args.dataset, args.cnn, args.device = "digits", False, "cpu"
    args.epsilon, args.delta, args.clip = 8.0, 1e-5, 0.05  # peers.py --table's DP row
    split = Split()
    instrument(split)
    runs = []
    for _ in range(args.repeats):
        split.ends.clear()
        split.cpu_ends.clear()
        before = len(split.rounds)
        run_once(args)
        runs.append(split.rounds[before:])
    rounds = [r for run in runs for r in run]
    mean_round = statistics.fmean(r["round"] for r in rounds)
    print(f"privfedcal train, digits MLP, {args.clients} clients, {args.rounds} rounds, "
          f"{'DP-FedAvg' if args.dp else 'FedAvg'}, transcript and checkpoint on, 1 thread"
          f"{f', --client-batch {args.client_batch}' if args.client_batch > 1 else ''}; "
          f"{len(rounds)} timed rounds over {args.repeats} runs")
    print(f"round: mean {mean_round * 1e3:.1f} ms, median "
          f"{statistics.median(r['round'] for r in rounds) * 1e3:.1f} ms")
    split_means = {p: statistics.fmean(exclusive(r)[p] for r in rounds) for p in PARTS}
    cpu_means = {p: statistics.fmean(exclusive(main_cpu(r))[p] for r in rounds) for p in PARTS}
    mean_cpu = statistics.fmean(r["round cpu"] for r in rounds)
    print(f"main thread's CPU per round: mean {mean_cpu * 1e3:.1f} ms")
    print(f"  {'part':>22}   wall ms  share   main-thread CPU ms")
    for p in PARTS:
        print(f"  {p:>22}: {split_means[p] * 1e3:7.2f}  {split_means[p] / mean_round:6.1%}"
              f"   {cpu_means[p] * 1e3:7.2f}")
    writer = {k: statistics.fmean(r[f"writer {k}"] for r in rounds) for k in ("wall", "cpu")}
    print(f"  transcript writer thread (beside the round): wall {writer['wall'] * 1e3:.2f} ms, "
          f"CPU {writer['cpu'] * 1e3:.2f} ms per round")
    if args.cprofile:
        run_once(args, profile=True)
    harness.finish(args, {"round_mean": mean_round, "parts": split_means, "writer": writer,
                          "rounds": len(rounds), "round_cpu_mean": mean_cpu,
                          "parts_cpu": cpu_means})


if __name__ == "__main__":
    main()
