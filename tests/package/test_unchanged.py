"""Nothing a user does changes: the CLI's flags, the run folders, the engine's numbers bit for
bit, the report byte for byte and the resume of an interrupted run, each compared with what an
earlier version of the package wrote (``tests/data/before_refactor/``, its README says which
commit and how). Only public names are used: the CLI (``privfedcal.cli.main``), the Python
API (``privfedcal.train``) and safetensors.

Numbers and figures depend on the installed libraries as much as on this package: the exact
comparisons run when the versions recorded with the data are the installed ones and are
skipped otherwise (a fresh environment with another torch or matplotlib). The flags and the
run folders' file names are compared everywhere.

``python tests/package/test_unchanged.py --write`` writes the data again; run it only on the
commit the data is meant to describe, never to make a failing test pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "before_refactor"
PLACEHOLDER = "{RUN_DIR}"  # the folder's absolute path in report.html (it differs by machine)
LIBRARIES = ("torch", "numpy", "matplotlib", "pillow", "safetensors")
TIMING = {"seconds", "wall_seconds", "elapsed"}  # wall-clock keys, the only ones that vary
BASE = ["--clients", "4", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--quiet"]
FAST = [*BASE, "--no-transcript"]
# DP noise drawn from the run seed (--insecure-seeded-noise) makes a DP run repeatable; CKKS
# (--secagg, --secagg-updates) draws its encryption noise from the OS, so its sums vary in
# the last bits from run to run and no secure-aggregation run is pinned here
ENGINE: dict[str, list[str]] = {
    "fedavg": [],
    "fedprox": ["--method", "fedprox", "--mu", "0.01"],
    "moon": ["--method", "moon"],
    "feduv": ["--method", "feduv"],
    "ccvr": ["--method", "ccvr"],
    "creff": ["--method", "creff"],
    "client-batch-2": ["--method", "fedprox", "--client-batch", "2"],
    "ccvr-dp-seeded": ["--method", "ccvr", "--dp-eps", "8", "--insecure-seeded-noise"],
    "creff-dp-updates-seeded": ["--method", "creff", "--dp-eps", "8", "--dp-updates",
                                "--dp-adaptive-clip", "--insecure-seeded-noise"],
}
# the resumed run: 3 rounds, stopped after round 1; its uninterrupted twin is an engine case
RESUMED = {"method": "ccvr", "rounds": 3, "dp_eps": 30.0, "dp_updates": True,
           "dp_adaptive_clip": True, "insecure_seeded_noise": True}
ENGINE["resume-whole"] = ["--method", "ccvr", "--rounds", "3", "--dp-eps", "30",
                          "--dp-updates", "--dp-adaptive-clip", "--insecure-seeded-noise"]
KWARGS = {"clients": 4, "local_epochs": 1, "device": "cpu", "threads": 1, "alpha": 0.5,
          "transcript": False}  # FAST as keywords


def installed() -> dict[str, str]:
    return {name: version(name) for name in LIBRARIES}


def needs_same_libraries(recorded: dict[str, str]) -> None:
    now = installed()
    if now != recorded:
        pytest.skip(f"libraries differ from the recorded ones: {recorded} here {now}")


def quiet_cli(args: list[str]) -> None:
    """``privfedcal ARGS`` in this process, its console output dropped."""
    from privfedcal.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(args)


def untimed(value: Any) -> Any:
    """``value`` without its wall-clock entries, at any depth."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items()
                if k not in TIMING and not k.endswith("_seconds")}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def model_digest(path: Path) -> str:
    """SHA-256 over a safetensors file's tensors in sorted key order (name, dtype, shape and
    bytes of each), independent of the file's header layout."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for key, tensor in sorted(load_file(str(path)).items()):
        h.update(f"{key}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        h.update(tensor.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def lines(path: Path) -> list[Any]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def record(run: Path) -> dict[str, Any]:
    """What a user reads from a finished run folder, timings left out: its file names, the
    config (its own path and the library versions out), per-round metrics, per-client
    records, the summary and the final model's digest."""
    config = json.loads((run / "config.json").read_text())
    config["out"] = PLACEHOLDER if config.get("out") else config.get("out")
    config["versions"] = sorted(config.get("versions") or {})
    return {
        "files": sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()),
        "config": config,
        "metrics": untimed(lines(run / "metrics.jsonl")),
        "clients": untimed(lines(run / "clients.jsonl")),
        "summary": untimed(json.loads((run / "summary.json").read_text())),
        "model_sha256": model_digest(run / "final" / "state.safetensors"),
    }


def train_case(args: list[str], out: Path) -> dict[str, Any]:
    quiet_cli(["train", *FAST, *args, "--out", str(out)])
    return record(out)


def cli_flags() -> dict[str, list[str]]:
    """Every command's options (each spelling) and arguments, from typer's click commands."""
    import click
    import typer

    from privfedcal.cli.main import app

    found: dict[str, list[str]] = {}

    def walk(command: click.Command, path: str) -> None:
        names = []
        for p in command.params:
            if isinstance(p, click.Option):
                names += [*p.opts, *p.secondary_opts]
            else:
                names.append(f"ARGUMENT {p.name}")
        found[path] = sorted(names)
        if isinstance(command, click.Group):  # list_commands: groups that build their own
            ctx = click.Context(command, info_name=path or "privfedcal")
            for name in sorted(command.list_commands(ctx)):
                walk(command.get_command(ctx, name), f"{path} {name}".strip())

    walk(typer.main.get_command(app), "")
    return found


def render_report(run: Path) -> bytes:
    """``privfedcal report RUN``'s page with the folder's path as ``PLACEHOLDER``."""
    quiet_cli(["report", str(run)])
    page = (run / "report.html").read_bytes()
    return page.replace(str(run.resolve()).encode(), PLACEHOLDER.encode())


def stop_after_round_1(rec: dict[str, Any]) -> None:
    if rec["round"] == 1:
        raise KeyboardInterrupt  # as Ctrl-C after round 1's checkpoint


# ---- the tests -----------------------------------------------------------------------------

def _engine() -> dict[str, Any]:
    return json.loads((DATA / "engine.json").read_text())


@pytest.mark.parametrize("name", sorted(ENGINE))
def test_engine_numbers_are_unchanged(name, tmp_path):
    golden = _engine()
    want = golden["cases"][name]
    assert want["args"] == ENGINE[name]  # the data describes the case the test runs
    run = tmp_path / "run"
    if installed() != golden["libraries"]:  # the run folder's files and config at least
        quiet_cli(["train", *FAST, *want["args"], "--out", str(run)])
        assert set(want["files"]) <= {p.relative_to(run).as_posix() for p in run.rglob("*")}
        needs_same_libraries(golden["libraries"])
    got = train_case(want["args"], run)
    missing = sorted(set(want["files"]) - set(got["files"]))
    assert not missing, f"files a run folder had before: {missing}"
    for key in ("config", "metrics", "clients", "summary", "model_sha256"):
        assert got[key] == want[key], f"{name}: {key} changed"


def test_cli_keeps_every_flag():
    before = json.loads((DATA / "cli_flags.json").read_text())
    now = cli_flags()
    gone = {cmd: sorted(set(flags) - set(now.get(cmd, []))) for cmd, flags in before.items()}
    gone = {cmd: flags for cmd, flags in gone.items() if flags or cmd not in now}
    assert not gone, f"commands or flags that existed before: {gone}"


def test_report_is_byte_identical(tmp_path):
    needs_same_libraries(_engine()["libraries"])
    run = shutil.copytree(DATA / "report" / "run", tmp_path / "run")
    want = (DATA / "report" / "report.html").read_bytes()
    got = render_report(run)
    assert got == want, "report.html differs from the one rendered before"


def test_a_run_interrupted_before_resumes_to_the_uninterrupted_result(tmp_path):
    run = shutil.copytree(DATA / "resume" / "run", tmp_path / "run")
    quiet_cli(["train", "--resume", str(run), "--quiet"])
    golden = _engine()
    whole = golden["cases"]["resume-whole"]
    assert [r["round"] for r in lines(run / "metrics.jsonl")] == [1, 2, 3]
    needs_same_libraries(golden["libraries"])
    got = record(run)
    for key in ("metrics", "clients", "summary", "model_sha256"):
        assert got[key] == whole[key], f"resumed run: {key} differs from the whole run's"


# ---- writing the data (on the commit it describes) -----------------------------------------

def _write_engine(scratch: Path) -> dict[str, Any]:
    cases = {}
    for name, args in ENGINE.items():
        first = train_case(args, scratch / name / "a")
        again = train_case(args, scratch / name / "b")
        assert first == again, f"{name} is not repeatable: not a golden case"
        cases[name] = {"args": args, **first}
    return {"libraries": installed(), "cases": cases}


def _write_report(scratch: Path) -> None:
    """A CCVR run under DP with a class-set and a statistics-inversion attack and the
    analysis figures: every section of the run report; the files the report does not read
    (server transcript, checkpoints) are left out."""
    made = scratch / "report-run"
    quiet_cli(["train", *BASE, "--method", "ccvr", "--dp-eps", "8",
               "--insecure-seeded-noise", "--out", str(made)])
    quiet_cli(["attack", "classes", "--run", str(made)])
    quiet_cli(["attack", "invert", "--run", str(made), "--stats", "--steps", "5",
               "--restarts", "1", "--clients", "0", "--threads", "1", "--quiet"])
    quiet_cli(["analyze", "--run", str(made), "--max-clients", "2", "--quiet"])
    target = DATA / "report" / "run"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(made, target, ignore=shutil.ignore_patterns(
        "transcript", "checkpoint", "final", "report.html"))
    page = render_report(shutil.copytree(target, scratch / "rendered"))
    assert render_report(shutil.copytree(target, scratch / "again")) == page  # repeatable
    (DATA / "report" / "report.html").write_bytes(page)


def _write_resume(scratch: Path, whole: dict[str, Any]) -> None:
    import privfedcal

    target = DATA / "resume" / "run"
    shutil.rmtree(target, ignore_errors=True)
    with contextlib.suppress(KeyboardInterrupt), contextlib.redirect_stderr(io.StringIO()):
        privfedcal.train(out=target, progress=stop_after_round_1, **KWARGS, **RESUMED)
    check = shutil.copytree(target, scratch / "resumed")
    quiet_cli(["train", "--resume", str(check), "--quiet"])
    got = record(check)
    for key in ("metrics", "clients", "summary", "model_sha256"):
        assert got[key] == whole[key], f"resume differs from the whole run: {key}"


def write_all() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        engine = _write_engine(scratch)
        (DATA / "engine.json").write_text(json.dumps(engine, indent=1) + "\n")
        (DATA / "cli_flags.json").write_text(json.dumps(cli_flags(), indent=1) + "\n")
        _write_report(scratch)
        _write_resume(scratch, engine["cases"]["resume-whole"])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/package/test_unchanged.py --write")
    import torch

    torch.set_num_threads(1)
    write_all()
