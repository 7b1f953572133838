"""benchmarks/engine/peers.py cannot flatter privfedcal: every way does the same work per
round, counted from inside the runs themselves (SGD steps, training samples, evaluation
samples), and work added to one way is caught.

pfl-research runs where an interpreter with ``pfl`` is found (this one, or the one named by
``PRIVFEDCAL_PFL_PYTHON``); Flower's simulation engine (Ray's start-up) only with ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "engine" / "peers.py"
TINY = ["--count", "--rounds", "3", "--clients", "3"]
DIGITS_TEST = 451  # the digits test split: one evaluation of it per round


def load_peers():
    spec = importlib.util.spec_from_file_location("peers_under_test", PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pfl_python() -> str | None:
    named = os.environ.get("PRIVFEDCAL_PFL_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("pfl") is not None else None


def count(tmp_path: Path, name: str, *flags: str) -> tuple[int, dict[str, list[dict]]]:
    """peers.py --count at tiny size: (exit status, each way's per-round work)."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(PEERS), *TINY, *flags, "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text())["results"]["workloads"][0]["work"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, list[dict]]:
    code, work = count(tmp_path_factory.mktemp("peers"), "base", "--ways", "privfedcal,bare")
    assert code == 0
    return work


def test_privfedcal_and_the_bare_loop_do_the_same_work_per_round(baseline):
    assert [r["round"] for r in baseline["privfedcal"]] == [2, 3]  # round 1 is not timed
    for rounds in baseline.values():
        for r in rounds:
            assert r["steps"] == r["train_batches"] > 0  # one backward pass per step
            assert r["train_samples"] > r["steps"]
            assert r["eval_samples"] == DIGITS_TEST  # the test set, once per round
    assert load_peers().work_differences(baseline) == []


def test_work_added_to_one_way_is_caught(baseline, tmp_path):
    peers = load_peers()
    code, work = count(tmp_path, "extra", "--ways", "bare", "--client-eval", "bare")
    extra = work["bare"]
    # every client's data evaluated before and after its training, as pfl's
    # evaluation_frequency=1 does: two more passes over the clients' data, as many samples
    # as their two local epochs train on
    assert [r["eval_samples"] for r in extra] == [
        DIGITS_TEST + r["train_samples"] for r in extra]
    found = peers.work_differences({"privfedcal": baseline["privfedcal"], "bare": extra})
    assert found and all("eval_samples" in f for f in found)


def test_dp_fedavg_trains_the_same_clients_as_fedavg(baseline, tmp_path):
    """Under --dp-updates privfedcal would draw a secret partition seed; the benchmark pins
    the partition every way shares, so only the server's clip and noise are added."""
    _, work = count(tmp_path, "dp", "--ways", "privfedcal", "--dp")
    assert load_peers().work_differences({"fedavg": baseline["privfedcal"],
                                          "dp": work["privfedcal"]}) == []


def test_the_vectorised_trainer_does_the_same_work(baseline, tmp_path):
    """privfedcal with --client-batch trains every client of the round at once under vmap,
    where module hooks cannot count its steps: counted from the step plan it runs, its work
    is the sequential run's, and the plan's padding rows are not counted as samples."""
    _, work = count(tmp_path, "vec", "--ways", "privfedcal", "--client-batch", "3")
    vec = work["privfedcal"]
    assert vec and all(r["steps"] > 0 for r in vec)
    assert load_peers().work_differences({"bare": baseline["bare"], "vec": vec}) == []


def test_a_plan_that_counts_padding_rows_is_caught(baseline):
    """The count of the vectorised trainer's plan can fail: padding rows counted as
    training samples differ from the sequential run's."""
    peers = load_peers()
    padded = [dict(r, train_samples=r["train_samples"] + 5) for r in baseline["privfedcal"]]
    found = peers.work_differences({"bare": baseline["bare"], "vec": padded})
    assert found and all("train_samples" in f for f in found)


def need_pfl() -> str:
    python = pfl_python()
    if python is None:
        pytest.skip("pfl-research is not installed (pip install 'pfl[pytorch]==0.6.0'; "
                    "or name its interpreter in PRIVFEDCAL_PFL_PYTHON)")
    return python


def test_pfl_does_the_same_work(baseline, tmp_path):
    _, work = count(tmp_path, "pfl", "--ways", "pfl", "--pfl-python", need_pfl())
    assert load_peers().work_differences({"privfedcal": baseline["privfedcal"], **work}) == []


@pytest.mark.slow
def test_pfl_client_evaluation_is_caught(baseline, tmp_path):
    """pfl's evaluation_frequency=1, the setting this benchmark had before, fails the check."""
    _, work = count(tmp_path, "pfl-eval", "--ways", "pfl", "--pfl-python", need_pfl(),
                    "--client-eval", "pfl")
    found = load_peers().work_differences({"privfedcal": baseline["privfedcal"], **work})
    assert found and all("eval_samples" in f for f in found)


@pytest.mark.slow
@pytest.mark.flower
def test_flower_does_the_same_work(baseline, tmp_path):
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    peers = load_peers()
    _, work = count(tmp_path, "flower", "--ways", "flower")
    assert peers.work_differences({"privfedcal": baseline["privfedcal"], **work}) == []


def test_privfedcal_round_line_is_the_tick_the_driver_reads():
    """privfedcal's timed round ends at its own progress line: a changed line would leave
    the driver without ticks."""
    from privfedcal.cli.run_progress import progress_line

    peers = load_peers()
    line = progress_line({"round": 7, "accuracy": 0.5, "loss": 1.0, "train_loss": None,
                          "seconds": 0.1}, 20)
    lines = [(1.0, "privfedcal: fedavg on digits [6/20]"), (2.0, line), (2.5, line)]
    assert [(t, r["round"]) for t, r in peers.round_ticks(lines)] == [(2.0, 7), (2.5, 7)]
    assert peers.round_ticks([(3.0, 'peers-tick {"round": 2}'), (4.0, line)]) == [
        (3.0, {"round": 2})]
